"""Train a small MLP on data it generates, on whatever device the worker has (CUDA, MPS or CPU).

Payload: {"hidden": 64, "lr": 0.01, "steps": 300, "seed": 0}. Result: final train and test loss.
Needs torch on the worker (`pip install -e '.[gpu]'`):

    gpumesh submit examples/torch_regression.py --payloads examples/torch_payloads.json --wait
"""

import json
import os
import sys
import time

import torch

payload = json.load(sys.stdin)
device = torch.device(os.environ.get("GPUMESH_DEVICE", "cpu"))
torch.manual_seed(int(payload.get("seed", 0)))

# y = sin(3x) * x + noise, 4096 points; the last quarter is held out
x = torch.linspace(-2, 2, 4096, device=device).unsqueeze(1)
y = torch.sin(3 * x) * x + 0.05 * torch.randn_like(x)
perm = torch.randperm(len(x), device=device)
train, test = perm[:3072], perm[3072:]

hidden = int(payload["hidden"])
model = torch.nn.Sequential(
    torch.nn.Linear(1, hidden),
    torch.nn.Tanh(),
    torch.nn.Linear(hidden, hidden),
    torch.nn.Tanh(),
    torch.nn.Linear(hidden, 1),
).to(device)
opt = torch.optim.Adam(model.parameters(), lr=float(payload["lr"]))
loss_fn = torch.nn.MSELoss()

start = time.perf_counter()
for step in range(int(payload["steps"])):
    opt.zero_grad()
    loss = loss_fn(model(x[train]), y[train])
    loss.backward()
    opt.step()
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.5f}", file=sys.stderr)

with torch.no_grad():
    test_loss = loss_fn(model(x[test]), y[test]).item()
print(
    json.dumps(
        {
            "hidden": hidden,
            "lr": float(payload["lr"]),
            "train_loss": round(loss.item(), 6),
            "test_loss": round(test_loss, 6),
            "device": str(device),
            "seconds": round(time.perf_counter() - start, 3),
        }
    )
)
