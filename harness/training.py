"""Training rows of one measured block: a small model around the side's op, trained from the seed.

Called by harness/measure/blocks_worker.py after the operator rows, in the same fresh block
process, with the op already imported from the side's worktree. The model file is loaded by path
from the harness's checkout (both sides run the same model code; only the attention function
differs), the model is built on the CPU from `torch.manual_seed(row.seed)` and moved to the device,
the data are drawn on the CPU from a generator seeded with `row.seed`, and the optimizer is AdamW:
the two sides start from the same parameters and see the same tokens.

Per row: `warmup_steps` untimed optimizer steps (the first one's loss is the first-step loss: same
parameters and data on both sides, so it must agree across sides), then `steps` timed ones (CUDA
events around each step on a GPU, perf_counter after a synchronise on the CPU); the peak allocation
is max_memory_allocated() over the timed steps, after reset_peak_memory_stats() (CUDA only, the
whole training state: parameters, optimizer moments, activations). A non-finite loss fails the row.

Records (records.py): train_step {row, step, warmup, ms, loss, tokens} for every step, then
train_row {row, tokens, first_loss, final_loss, peak_bytes, params, config} once the row is done;
a failure is `failure {shape: row, mode: "train", error}`.
"""
from __future__ import annotations

import importlib.util
import math
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

TRAIN_MODE = "train"  # the `mode` of a training row's failure records


def load_build_fn(file: str, fn: str):
    spec = importlib.util.spec_from_file_location(f"_harness_train_model_{Path(file).stem}", file)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    if not hasattr(module, fn):
        raise AttributeError(f"{file} has no function {fn!r}")
    return getattr(module, fn)


def make_batch(row: dict, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input_ids, labels, cu_seqlens): B rows of T+1 tokens drawn from the row's seed; varlen packs
    them into [1, B*T] with document boundaries every context_len tokens."""
    gen = torch.Generator(device="cpu").manual_seed(int(row["seed"]) + 1)
    B, T = int(row["B"]), int(row["T"])
    tokens = torch.randint(0, int(row["vocab"]), (B, T + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    cu = None
    if row.get("varlen"):
        c = int(row["context_len"])
        ids, labels = ids.reshape(1, B * T), labels.reshape(1, B * T)
        cu = torch.tensor(list(range(0, B * T, c)) + [B * T], dtype=torch.int32).to(device)
    return ids.contiguous().to(device), labels.contiguous().to(device), cu


def build(row: dict, op, device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    build_fn = load_build_fn(row["model_file"], row["model_fn"])
    cfg = {k: row[k] for k in ("vocab", "hidden", "heads", "head_dim", "layers", "dtype")}
    torch.manual_seed(int(row["seed"]))
    model = build_fn(cfg, op).to(device)
    if row.get("optimizer", "adamw") != "adamw":
        raise ValueError(f"optimizer {row['optimizer']!r} is not supported (adamw only)")
    opt = torch.optim.AdamW(model.parameters(), lr=float(row["lr"]), weight_decay=float(row.get("weight_decay", 0.0)))
    return model, opt


class TrainingRun:
    """One training row, built and ready to step: the model, optimizer and batch of `row`, around `op`."""

    def __init__(self, row: dict, op, device):
        self.row = row
        self.cuda = device == "cuda" or str(device).startswith("cuda")
        self.model, self.opt = build(row, op, device)
        self.ids, self.labels, self.cu = make_batch(row, device)
        self.first_loss = self.final_loss = None
        self.steps_done = 0

    def _step(self) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.ids, labels=self.labels, cu_seqlens=self.cu)
        loss.backward()
        self.opt.step()
        return loss.detach()

    def step(self, warmup: bool = False) -> tuple[float, float]:
        """One optimizer step: (ms, loss), timed with CUDA events on a GPU (perf_counter on a CPU).
        A non-finite loss raises FloatingPointError."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = self._step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            loss = self._step()
            ms = (time.perf_counter() - t0) * 1e3
        value = float(loss.item())
        if not math.isfinite(value):
            raise FloatingPointError(f"non-finite loss {value} at step {self.steps_done}{' (warm-up)' if warmup else ''}")
        if self.steps_done == 0:
            self.first_loss = value
        self.final_loss = value
        self.steps_done += 1
        return ms, value

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def summary(self) -> dict:
        """First/final loss, the peak allocation since reset_peak (CUDA only), parameter count."""
        peak = None
        if self.cuda:
            torch.cuda.synchronize()
            peak = int(torch.cuda.max_memory_allocated())
        return {"first_loss": self.first_loss, "final_loss": self.final_loss, "peak_bytes": peak,
                "params": sum(p.numel() for p in self.model.parameters())}


def train_steps(row: dict, op, device, on_step: Callable[[int, bool, float, float], None]) -> dict:
    """Build and train one row; `on_step(step, warmup, ms, loss)` after every step. Returns the
    row's summary (first/final loss, peak bytes over the timed steps, parameter count)."""
    run = TrainingRun(row, op, device)
    warm, timed = int(row["warmup_steps"]), int(row["steps"])
    for i in range(warm + timed):
        warmup = i < warm
        if i == warm:
            run.reset_peak()
        ms, loss = run.step(warmup)
        on_step(i, warmup, ms, loss)
    return run.summary()


def run_training_rows(job: dict, emit: Callable[..., None], op, device) -> None:
    """Every training row of the job, one after the other; a failing row is recorded and skipped."""
    for row in job.get("training") or []:
        name = row["name"]
        tokens = int(row["B"]) * int(row["T"])
        try:
            summary = train_steps(row, op, device, lambda i, w, ms, loss: emit(
                "train_step", row=name, step=i, warmup=w, ms=ms, loss=loss, tokens=tokens))
            config = {k: v for k, v in row.items() if k not in ("model_file",)}
            emit("train_row", row=name, tokens=tokens, config=config, **summary)
        except Exception as e:
            emit("failure", shape=name, mode=TRAIN_MODE, error=f"{type(e).__name__}: {e}",
                 trace=traceback.format_exc(limit=8))
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
