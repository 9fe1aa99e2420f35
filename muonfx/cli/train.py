"""One training run: the stdlib corpus, a small GPT, a muonfx optimizer, warm-up + linear decay.

:func:`train_run` trains one optimizer and returns its record (loss curves, final
losses, timing, param groups). Data: at every step a batch of ``--batch-size`` random
windows is drawn from the training split with a ``torch.Generator`` seeded with
``--seed`` (under ``--fsdp`` every rank draws the same batch and keeps its own
``batch_size / world`` rows, so the global batch does not depend on the world
size). The validation loss is the mean over ``--eval-batches`` fixed batches of the
validation split (the same ones at every evaluation and for every optimizer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time

import torch

from .checkpoint import CheckpointError, restore, save_checkpoint
from .corpus import Corpus, sample_batch
from .estimate import RunClock
from .interrupt import Interrupted, StepInterrupt
from ..attention import QKLogitRecorder
from ..optim.qk_clip import QKClip
from .model import GPT, MODELS
from .optimizers import build_optimizer, describe
from .progress import Progress, format_rate, format_time
from .runtime import Runtime, shard_model

__all__ = ["WarmupLinear", "train_run", "evaluate"]

EVAL_SEED = 20240601  # the validation batches' generator seed: fixed, independent of --seed
#: a first validation batch slower than this (seconds) gets a rough time estimate at once
ROUGH_ESTIMATE_AFTER_S = 1.0


class WarmupLinear:
    """LambdaLR factor: ``(s + 1) / warmup`` for the first ``warmup`` steps, then linear to 0 at ``total``.

    Example::

        >>> f = WarmupLinear(warmup=2, total=6)
        >>> [round(f(s), 2) for s in range(7)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


def _rows(x: torch.Tensor, rt: Runtime) -> torch.Tensor:
    if not rt.fsdp:
        return x
    n = x.shape[0] // rt.world
    return x[rt.rank * n:(rt.rank + 1) * n]


def _autocast(rt: Runtime):
    return torch.autocast(rt.device.type, dtype=torch.bfloat16) if rt.amp else contextlib.nullcontext()


def _sync(rt: Runtime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


@torch.no_grad()
def evaluate(model: GPT, corpus: Corpus, batches: int, batch_size: int, context: int, rt: Runtime,
             after_first=None) -> float:
    """Mean loss over the fixed validation batches; ``after_first(seconds)`` is called
    with the time of the first batch (for a first time estimate)."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=rt.device)
    for i in range(batches):
        t0 = time.perf_counter()
        x, y = sample_batch(corpus.val, batch_size, context, gen)
        with _autocast(rt):
            total += model.loss(_rows(x, rt).to(rt.device), _rows(y, rt).to(rt.device)).float()
        if i == 0 and after_first is not None:
            _sync(rt)
            after_first(time.perf_counter() - t0)
    model.train(was_training)
    return float(rt.all_mean(total / batches))


def _settings(args, name: str) -> dict:
    keys = ("lr", "adamw_lr", "weight_decay", "batch_size", "model", "context", "seed", "warmup", "grad_clip",
            "steps", "eval_every", "eval_batches", "amp", "ns_method", "qk_clip")
    s = {k: getattr(args, k) for k in keys}
    s["optimizer"] = name
    s["threads"] = torch.get_num_threads()  # the sums' rounding: --resume reuses it
    return s


def train_run(args, name: str, corpus: Corpus, rt: Runtime, lr: float | None, checkpoint: dict | None = None,
              then: str | None = None) -> dict:
    """Train ``--model`` with optimizer ``name`` for ``args.steps`` steps (or to ``--stop-at``);
    ``then`` names the ``--compare`` run that follows (for the time estimate).

    A Ctrl-C, SIGTERM or SIGHUP from here on stops the run at the last completed step
    (see :mod:`muonfx.cli.interrupt`): a step still in its forward or backward pass is
    abandoned (its gradients dropped, its batch drawn again by the resumed run), a step
    inside ``opt.step()`` is finished (under ``--fsdp`` every rank finishes the current
    step). With ``--save`` the checkpoint is the state after that step, and ``--resume``
    goes on exactly as an uninterrupted run would; then
    :class:`~muonfx.cli.interrupt.Interrupted` (a ``KeyboardInterrupt``) is raised."""

    def on_signal(signum: int) -> None:  # in the handler: an unbuffered write (print could re-enter its buffer)
        if rt.is_main:
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            how = ("finishing the current step on all ranks" if rt.fsdp else
                   "stopping at the last completed step (a step in its forward or backward pass is abandoned, "
                   "one inside opt.step() finishes first)")
            os.write(2, (f"\n[{name}] {what}: {how}, then "
                         f"{'saving to ' + str(args.save) if args.save else 'stopping (no --save: nothing is saved)'}"
                         f"{'' if rt.fsdp else f'; {what} again quits now without saving'}\n").encode())

    with StepInterrupt(on_signal, force_on_second=not rt.fsdp) as ctrl_c:
        return _train(args, name, corpus, rt, lr, checkpoint, then, ctrl_c)



def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False

def _train(args, name: str, corpus: Corpus, rt: Runtime, lr: float | None, checkpoint: dict | None,
           then: str | None, ctrl_c: StepInterrupt) -> dict:
    cfg = dataclasses.replace(MODELS[args.model], vocab=corpus.vocab_size)
    if args.context:
        cfg = dataclasses.replace(cfg, context=args.context)
    T, B = cfg.context, args.batch_size
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(rt.device)
    n_params = model.num_params()
    if rt.fsdp:
        shard_model(model, rt)
    tau = getattr(args, "qk_clip", 0.0) or 0.0
    recorder = QKLogitRecorder() if tau > 0 or getattr(args, "log_max_logit", False) else None
    model.record_logits(recorder)
    clip = QKClip(recorder, model.qk_layout(), tau=tau) if tau > 0 else None
    opt = build_optimizer(name, model, lr, args.adamw_lr, args.weight_decay, args.ns_method, qk_clip=clip)
    logit_curve: list = []  # [step, the largest logit of any head] at every logged step
    last_logits: dict = {}
    groups = describe(opt)  # before the scheduler scales the lrs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupLinear(args.warmup, args.steps))
    gen = torch.Generator().manual_seed(args.seed)
    history: dict = {"train": [], "val": []}
    start = 0
    if checkpoint is not None:
        start = restore(checkpoint, rt, model, opt, sched, gen)
        history = checkpoint["history"]
    stop = args.stop_at or args.steps
    # the bar only on a terminal: a redirected log gets the loss lines, not a bar line per update
    log = Progress(stop, start, name, enabled=rt.is_main and not args.no_progress and _is_terminal(sys.stderr))
    say = log.write if rt.is_main else (lambda line: None)
    clock = RunClock(args.steps, stop, args.eval_every, args.eval_batches)
    where = f"{rt.device.type}" + (f" ({torch.get_num_threads()} thread(s))" if rt.device.type == "cpu" else "")

    def first_batch(seconds: float) -> None:  # a big model on a slow device: say something before it is too late
        if seconds >= ROUGH_ESTIMATE_AFTER_S:
            say(clock.rough(seconds, f"{B} x {T}", name, where))
    if start == 0:
        split = ", ".join(f"{g['tx']} lr {g['lr']:g} on {g['tensors']} tensors ({g['params'] / 1e3:.0f}k)"
                          for g in groups)
        say(f"[{name}] {args.model}: {n_params / 1e6:.2f}M parameters, {cfg.layers}x{cfg.d}, {cfg.heads} heads, "
            f"context {T}; batch {B}; {args.steps} steps on {rt.device}"
            f"{f' ({torch.get_num_threads()} thread(s))' if rt.device.type == 'cpu' else ''}"
            f"{f' x{rt.world} ranks (FSDP2, {rt.backend})' if rt.fsdp else ''}; {split}")
        te = time.perf_counter()
        v = evaluate(model, corpus, args.eval_batches, B, T, rt, after_first=first_batch)
        clock.eval_seconds = time.perf_counter() - te
        log.exclude(clock.eval_seconds)
        history["val"].append([0, v])
        say(f"[{name}] step {0:5d} | val {v:.4f}")
    else:
        say(f"[{name}] resumed at step {start} of {args.steps}")
    model.train()
    t0 = time.perf_counter()
    eval_seconds = 0.0
    eval_times = [clock.eval_seconds] if clock.eval_seconds is not None else []  # this process's evaluations
    step = start
    pending: list[torch.Tensor] = []
    sync_every = 1 if rt.device.type == "cpu" else 10

    save_error: list[str] = []

    def save() -> None:
        if args.save:
            try:
                save_checkpoint(args.save, rt, model, opt, sched, step, gen, history, _settings(args, name),
                                corpus.sha256)
            except CheckpointError as e:  # a full disk: said in one line, the partial file removed
                save_error.append(str(e))
                say(f"[{name}] could not save step {step}: {e}")
                return
            say(f"[{name}] saved step {step} to {args.save}")

    def record(got: torch.Tensor) -> list[float]:  # the synced losses of the completed steps
        losses = got[:, 0].tolist()
        history["train"].extend([step - len(losses) + 1 + i, v] for i, v in enumerate(losses))
        return losses

    def abandon(where: str) -> bool:
        """A signal came during the step's forward or backward pass: drop the step (its
        gradients; the data generator back to before its batch). Not under --fsdp, whose
        ranks would have to agree on it in the middle of FSDP2's collectives."""
        nonlocal pending
        if not ctrl_c.requested or rt.fsdp:
            return False
        opt.zero_grad(set_to_none=True)
        gen.set_state(data_rng)
        torch.set_rng_state(torch_rng)
        if pending:
            losses = record(torch.stack(pending))
            log.update(step, losses[-1], len(losses) * B * T, "")
            pending = []
        say(f"[{name}] step {step + 1} abandoned {where}: the parameters and optimizer state are those of "
            f"step {step}")
        return True

    interrupted = False
    while step < stop:
        timing = not clock.reported
        ts = time.perf_counter()
        data_rng, torch_rng = gen.get_state(), torch.get_rng_state()  # what a checkpoint of the last step holds
        x, y = sample_batch(corpus.train, B, T, gen)
        with _autocast(rt):
            loss = model.loss(_rows(x, rt).to(rt.device), _rows(y, rt).to(rt.device))
        if abandon("after its forward pass"):
            interrupted = True
            break
        loss.backward()
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        if abandon("after its backward pass"):  # from here on, the step is finished (opt.step() is waited for)
            interrupted = True
            break
        if timing:
            _sync(rt)
            tb = time.perf_counter()
        if recorder is not None:  # the step's statistics, before the step resets them
            last_logits = recorder.maxima()
            if clip is None:
                recorder.reset()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if timing:
            _sync(rt)
            clock.add_step(tb - ts, time.perf_counter() - tb)
            if clock.ready() or (step == stop and then):
                say(clock.measured(step, name, then))
        # the Ctrl-C flag rides with the loss's all-reduce: every rank sees the same value
        flag = torch.tensor(float(ctrl_c.requested), device=rt.device)
        pending.append(rt.all_mean(torch.stack([loss.detach().float(), flag])))
        if len(pending) >= sync_every or step == stop or step % args.eval_every == 0 \
                or (ctrl_c.requested and not rt.fsdp):  # under --fsdp every rank syncs at the same steps
            got = torch.stack(pending)
            pending = []
            losses = record(got)
            interrupted = bool(got[:, 1].max() > 0)
            if not all(math.isfinite(v) for v in losses):
                say(f"[{name}] step {step}: the loss is {losses[-1]}; stopping (lower --lr / --adamw-lr?)")
                break
            if recorder is not None:
                logit_curve.append([step, round(max(float(m.max()) for m in last_logits.values()), 3)])
            shown = f"max logit {logit_curve[-1][1]:.1f}" if logit_curve else ""
            log.update(step, losses[-1], len(losses) * B * T, shown)
        if step % args.eval_every == 0 or step == args.steps:
            te = time.perf_counter()
            opt.eval()  # the evaluation weights, where the optimizer has them (Schedule-Free's average)
            v = evaluate(model, corpus, args.eval_batches, B, T, rt)
            opt.train()
            eval_times.append(time.perf_counter() - te)
            eval_seconds += eval_times[-1]
            log.exclude(eval_times[-1])
            history["val"].append([step, v])
            pace = (time.perf_counter() - t0 - eval_seconds) / (step - start)  # this run's, so far
            say(f"[{name}] step {step:5d} | train {history['train'][-1][1]:.4f} | val {v:.4f} | "
                f"lr x{sched.get_last_lr()[0] / opt.param_groups[0]['initial_lr']:.3f} | "
                f"{format_rate(log.tokens_per_s())} training | "
                f"{f'max logit {logit_curve[-1][1]:.1f} | ' if logit_curve else ''}"
                f"{clock.left(step, pace, sum(eval_times) / len(eval_times), then)}")
        if interrupted and step < stop:  # a whole step is done: stop here, as --stop-at would
            break
    if interrupted and step < stop:
        log.close()
        if step == 0:  # no step completed: nothing to save or lose
            say(f"[{name}] interrupted before step 1 completed; nothing is saved")
            raise Interrupted(ctrl_c.signum)
        save()
        say(f"[{name}] interrupted after step {step}" + (
            f"; continue exactly with: {getattr(args, 'prog', 'muonfx train')} --resume {args.save}" if args.save else
            f"; steps {start + 1}-{step} are lost (pass --save PATH to keep them on Ctrl-C)" if step > start else
            "; no step of this run completed (the checkpoint it resumed from is as it was)"))
        raise Interrupted(ctrl_c.signum)
    log.close()
    seconds = time.perf_counter() - t0
    train_seconds = max(seconds - eval_seconds, 1e-9)
    if step == stop:
        save()
    trained = step - start
    rec = {
        "optimizer": name, "lr": opt.param_groups[0]["initial_lr"], "param_groups": groups,
        "params": n_params, "steps": step, "schedule_steps": args.steps,
        "final_train_loss": history["train"][-1][1] if history["train"] else None,
        "final_val_loss": history["val"][-1][1] if history["val"] else None,
        "seconds": round(seconds, 2), "eval_seconds": round(eval_seconds, 2),
        "tokens_per_s": round(trained * B * T / train_seconds, 1),  # training steps only, evaluations excluded
        "val_curve": history["val"], "train_curve": history["train"],
    }
    if save_error:
        rec["save_error"] = save_error[-1]
    if recorder is not None:
        rec["qk_clip"] = tau or None
        rec["max_logit_curve"] = logit_curve
        rec["final_max_logit_per_head"] = {n: [round(float(v), 3) for v in m] for n, m in last_logits.items()}
    say(f"[{name}] done: {trained} steps in {format_time(seconds)}; final train {rec['final_train_loss']:.4f}, "
        f"val {rec['final_val_loss']:.4f}")
    return rec
