"""Batch inference with the model loaded once per worker (load once, run many).

    gpumesh submit examples/reuse_infer.py --payloads examples/reuse_payloads.json --reuse-process --wait

With --reuse-process each worker loads this module once, in the first task it runs of the job, and calls
main(payload) for every task after it in the same process: `import torch`, the CUDA context and the model's
weights are paid once per worker, not once per task. The model is built here (random weights, seeded): no
download. Run without --reuse-process it works too: the block at the end calls main once.
"""

import json
import os
import sys
import time

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_MODEL = None  # the loaded model: kept between the tasks a reused process runs


def _load() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(4096, 10)).to(DEVICE).eval()


def main(payload: dict) -> dict:
    global _MODEL
    started = time.perf_counter()
    loaded = _MODEL is not None
    if _MODEL is None:
        _MODEL = _load()
    gen = torch.Generator().manual_seed(int(payload["seed"]))
    with torch.inference_mode():
        x = torch.randn(int(payload.get("batch", 256)), 1024, generator=gen).to(DEVICE)
        classes = _MODEL(x).argmax(1)[:8].tolist()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        # What this task allocated goes back to the cache the next task allocates from; empty_cache() hands the
        # cache back to the driver only when another process on the card needs it (docs/reuse.md).
    return {
        "seed": payload["seed"], "classes": classes, "device": DEVICE, "pid": os.getpid(),
        "model_was_loaded": loaded, "ms": round((time.perf_counter() - started) * 1000, 2),
        "cuda_initialised": bool(DEVICE == "cuda" and torch.cuda.is_initialized()),
    }  # fmt: skip


if __name__ == "__main__":  # run once, as a plain script (without --reuse-process)
    print(json.dumps(main(json.load(sys.stdin))))
