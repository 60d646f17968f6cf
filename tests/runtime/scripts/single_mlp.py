"""An ordinary single-process training script (no torch.distributed at all).

Usage: single_mlp.py OUT_PATH [--epochs E] [--step-sleep S] [--device cpu|cuda] [--amp]
--device cuda: the model, its optimizer state and the augmentation noise on cuda:0, so dropout
and randn_like draw from the CUDA generator (bench/gpu_job_checks.py). OUT_PATH gets the final
parameters, optimizer state and RNG state (the CPU generator's, and the CUDA one's with cuda).
--amp: mixed precision as GPU scripts do it, autocast (float16 on cuda, bfloat16 on cpu) and a
GradScaler whose scale starts high enough that float16 gradients overflow now and then (skipped
steps, the scale backing off, growing every 4 steps); OUT_PATH also gets the scaler's state.
"""
import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(99)
    x = torch.randn(192, 6)
    y = (x[:, :1] * 2 - x[:, 1:2]).clone()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Dropout(0.1), nn.Linear(24, 1)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 24, growth_interval=4, enabled=args.amp)
    half = torch.float16 if device.type == "cuda" else torch.bfloat16
    for _epoch in range(args.epochs):
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            xb = xb + 0.05 * torch.randn_like(xb)  # random augmentation
            optimizer.zero_grad()
            with torch.autocast(device_type=device.type, dtype=half, enabled=args.amp):
                loss = nn.functional.mse_loss(model(xb).float(), yb)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            if args.step_sleep:
                time.sleep(args.step_sleep)
    rng = {"cpu": torch.get_rng_state()}
    if args.device == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(), "rng": rng,
                **({"scaler": scaler.state_dict()} if args.amp else {})}, args.out)


if __name__ == "__main__":
    main()
