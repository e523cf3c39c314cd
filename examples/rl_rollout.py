"""A rollout of many tiny policy steps, each one a graphified call.

The policy is a 2x64 tanh MLP with a Gaussian head; each step samples an
action with ``torch.randn`` inside the graphified function, advances a toy
linear environment and returns the next state, which is fed back as the next
step's input. Launch-bound work like this is what gtransform is for.

Random ops inside a graphified function draw fresh numbers on every call and
follow ``torch.manual_seed`` as eager does, so the rollout is checked against
an eager rollout from the same seed; the script exits non-zero if the final
state or the total reward differ beyond float32 tolerance.

    python examples/rl_rollout.py                 # cuda if available, else cpu
    python examples/rl_rollout.py --device cpu --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

import gtransform as gt

Tensors = Dict[str, torch.Tensor]
StepFn = Callable[[Tensors, Tensors, torch.Tensor], Tensors]

OBS, ACT, HIDDEN = 8, 2, 64


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init(device: torch.device, seed: int) -> Tuple[Tensors, Tensors]:
    """Policy parameters and a fixed, stable linear environment."""
    gen = torch.Generator().manual_seed(seed)

    def lin(n_in: int, n_out: int) -> torch.Tensor:
        return torch.randn(n_in, n_out, generator=gen) / n_in**0.5

    policy = {
        "w1": lin(OBS, HIDDEN),
        "b1": torch.zeros(HIDDEN),
        "w2": lin(HIDDEN, HIDDEN),
        "b2": torch.zeros(HIDDEN),
        "w_mu": lin(HIDDEN, ACT),
        "log_std": torch.full((ACT,), -0.5),
    }
    env = {"A": 0.9 * torch.eye(OBS) + 0.05 * lin(OBS, OBS), "B": 0.1 * lin(ACT, OBS)}
    return {k: v.to(device) for k, v in policy.items()}, {k: v.to(device) for k, v in env.items()}


def policy_step(policy: Tensors, env: Tensors, state: torch.Tensor) -> Tensors:
    h = torch.tanh(state @ policy["w1"] + policy["b1"])
    h = torch.tanh(h @ policy["w2"] + policy["b2"])
    mean = h @ policy["w_mu"]
    action = mean + policy["log_std"].exp() * torch.randn_like(mean)  # fresh noise every call
    next_state = state @ env["A"] + action @ env["B"]
    reward = -(next_state**2).sum(-1) - 0.01 * (action**2).sum(-1)
    return {"state": next_state, "action": action, "reward": reward}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout(
    step: StepFn, policy: Tensors, env: Tensors, state: torch.Tensor, steps: int, seed: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor, List[float]]:
    torch.manual_seed(seed)  # the graphified rollout draws the same numbers as eager
    total_reward = torch.zeros_like(state[:, 0])
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        out = step(policy, env, state)
        total_reward += out["reward"]  # consume the reward before the next call
        state = out["state"]  # fed back: the next call copies it in before overwriting it
        _sync(device)
        times.append(time.perf_counter() - t0)
    # `state` is an output of the last call: clone it before calling `step` again.
    return state.clone(), total_reward, times


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=default_device())
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16, help="parallel environments")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    device = torch.device(args.device)

    policy, env = init(device, args.seed)
    state0 = torch.randn(args.batch, OBS, generator=torch.Generator().manual_seed(args.seed + 1)).to(device)

    step = gt.graphify(policy_step)
    final_g, reward_g, times_g = rollout(step, policy, env, state0, args.steps, args.seed, device)
    final_e, reward_e, times_e = rollout(policy_step, policy, env, state0, args.steps, args.seed, device)

    steady_g = statistics.median(times_g[2:] or times_g)
    steady_e = statistics.median(times_e[2:] or times_e)
    print(f"device={device} steps={args.steps} envs={args.batch} policy=2x{HIDDEN} tanh MLP")
    print(f"graphify: first call {times_g[0] * 1e3:8.2f} ms, then median {steady_g * 1e6:9.1f} us/step")
    print(f"eager:    first call {times_e[0] * 1e3:8.2f} ms, then median {steady_e * 1e6:9.1f} us/step")
    print(f"mean total reward: graphify {reward_g.mean().item():.4f}, eager {reward_e.mean().item():.4f}")
    print(f"cache: {step.cache_info()}")

    ok = True
    if not torch.allclose(final_g, final_e, rtol=1e-4, atol=1e-5):
        print(f"FAIL: final state differs from eager (max abs diff {(final_g - final_e).abs().max().item():.3g})")
        ok = False
    if not torch.allclose(reward_g, reward_e, rtol=1e-4, atol=1e-4):
        print("FAIL: total reward differs from eager")
        ok = False
    print("OK: rollout matches eager" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
