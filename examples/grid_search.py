"""Hyperparameter search, one shard per payload, in pure Python.

Fits y = 3x - 2 (plus noise) by gradient descent with the payload's learning rate and epoch count,
and prints the final loss as the task's result. Run it through gpumesh:

    gpumesh submit examples/grid_search.py --payloads examples/payloads.json --wait
"""

import json
import os
import random
import sys

payload = json.load(sys.stdin)
lr = float(payload["lr"])
epochs = int(payload["epochs"])

rng = random.Random(payload.get("seed", 0))
xs = [rng.uniform(-1, 1) for _ in range(200)]
ys = [3 * x - 2 + rng.gauss(0, 0.1) for x in xs]

w = b = 0.0
for _ in range(epochs):
    gw = gb = 0.0
    for x, y in zip(xs, ys):
        err = w * x + b - y
        gw += 2 * err * x / len(xs)
        gb += 2 * err / len(xs)
    w -= lr * gw
    b -= lr * gb

loss = sum((w * x + b - y) ** 2 for x, y in zip(xs, ys)) / len(xs)
print(f"lr={lr} epochs={epochs} on {os.environ.get('GPUMESH_DEVICE', 'cpu')}", file=sys.stderr)
print(json.dumps({"lr": lr, "epochs": epochs, "w": round(w, 4), "b": round(b, 4), "loss": round(loss, 6)}))
