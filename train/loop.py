"""Token-bucketed training with label smoothing, periodic checkpoints and dev-BLEU selection."""
from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainOptions:
    # Padded source+target tokens per batch (about 1,100 real target tokens): small batches,
    # because on ~1 CPU core the budget buys only a few thousand updates.
    max_tokens: int = 4000
    max_len: int = 128              # longer pairs (in tokens, either side) are dropped
    # Peak learning rate, reached after `warmup` steps. High for a post-norm model because the
    # budget is a few epochs. v1 (d_model 256) used 1.2e-3 / 250; v2 (d_model 384) scales the
    # peak by sqrt(256/384) and warms up a little longer.
    lr: float = 1e-3
    warmup: int = 400
    label_smoothing: float = 0.1
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    max_minutes: float = 80.0       # wall-time budget of this invocation's training loop
    max_steps: int = 0              # 0 = no step limit
    checkpoint_minutes: float = 10.0
    dev_subset: int = 100           # dev rows scored at each checkpoint for model selection
    # Also keep each checkpoint's weights as snapshots/step-N.pt (model only),
    # so `python -m train.curve RUN_DIR` can score the learning curve on all of dev afterwards.
    keep_snapshots: bool = True
    # Steps a warm start (`--init-from`) already trained: the schedule continues from there instead
    # of warming up again, so a continued model resumes at the learning rate it stopped at.
    schedule_offset: int = 0
    seed: int = 1234
    # One thread: two threads beside other work on a 2-core machine oversubscribe it.
    threads: int = 1


def encode_pairs(tok, pairs, max_len: int) -> list[tuple[list[int], list[int]]]:
    """Token ids for (source, target) with eos appended; pairs longer than max_len are dropped."""
    vocab = tok.get_vocab()
    unk = tok.unk_token_id
    encoded = []
    src_pieces = tok.spm_source.encode([p.en for p in pairs], out_type=str)
    tgt_pieces = tok.spm_target.encode([p.zh for p in pairs], out_type=str)
    for s, t in zip(src_pieces, tgt_pieces):
        s_ids = [vocab.get(x, unk) for x in s] + [0]
        t_ids = [vocab.get(x, unk) for x in t] + [0]
        if len(s_ids) <= max_len and len(t_ids) <= max_len:
            encoded.append((s_ids, t_ids))
    return encoded


def make_batches(encoded, max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Length-sorted buckets so padding stays small; batch order is shuffled per epoch."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i][0]) + rng.random(), len(encoded[i][1])))
    batches, cur, cur_max = [], [], 0
    for i in order:
        longest = max(cur_max, len(encoded[i][0]), len(encoded[i][1]))
        if cur and longest * (len(cur) + 1) * 2 > max_tokens:
            batches.append(cur)
            cur, longest = [], max(len(encoded[i][0]), len(encoded[i][1]))
        cur.append(i)
        cur_max = longest
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(encoded, idx: list[int], pad: int):
    src = [encoded[i][0] for i in idx]
    tgt = [encoded[i][1] for i in idx]
    s_len, t_len = max(map(len, src)), max(map(len, tgt))
    input_ids = torch.full((len(idx), s_len), pad, dtype=torch.long)
    labels = torch.full((len(idx), t_len), -100, dtype=torch.long)
    # Decoder input is the target shifted right, starting from pad (= decoder_start_token_id).
    dec_in = torch.full((len(idx), t_len), pad, dtype=torch.long)
    for r, (s, t) in enumerate(zip(src, tgt)):
        input_ids[r, : len(s)] = torch.tensor(s)
        labels[r, : len(t)] = torch.tensor(t)
        dec_in[r, 1 : len(t)] = torch.tensor(t[:-1])
    return input_ids, input_ids.ne(pad).long(), dec_in, labels


def inverse_sqrt(warmup: int, offset: int = 0):
    def factor(step: int) -> float:
        step = max(step + offset, 1)
        return min(step / warmup, math.sqrt(warmup / step))
    return factor


class Trainer:
    def __init__(self, model, tok, encoded, dev_pairs, run_dir: Path, opts: TrainOptions):
        self.model, self.tok, self.encoded, self.dev_pairs = model, tok, encoded, dev_pairs
        self.run_dir, self.opts = run_dir, opts
        self.pad = model.config.pad_token_id
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=opts.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=opts.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, inverse_sqrt(opts.warmup, opts.schedule_offset))
        self.step, self.epoch, self.batch_pos = 0, 0, 0
        self.best_bleu, self.history = -1.0, []
        self.train_seconds = 0.0

    # -- checkpointing -------------------------------------------------------------------
    @property
    def latest_path(self) -> Path:
        return self.run_dir / "checkpoint-latest.pt"

    @property
    def best_path(self) -> Path:
        return self.run_dir / "best-model.pt"

    @property
    def snapshot_dir(self) -> Path:
        return self.run_dir / "snapshots"

    def save_checkpoint(self) -> None:
        if self.opts.keep_snapshots:
            self.snapshot_dir.mkdir(exist_ok=True)
            torch.save(self.model.state_dict(), self.snapshot_dir / f"step-{self.step}.pt")
        state = {
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "step": self.step, "epoch": self.epoch,
            "batch_pos": self.batch_pos, "best_bleu": self.best_bleu, "history": self.history,
            "train_seconds": self.train_seconds, "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
        }
        tmp = self.latest_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.latest_path)  # atomic: a kill mid-save leaves the previous checkpoint

    def load_checkpoint(self, keep_lr: bool = True) -> None:
        state = torch.load(self.latest_path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.epoch, self.batch_pos = state["step"], state["epoch"], state["batch_pos"]
        self.best_bleu, self.history = state["best_bleu"], state["history"]
        self.train_seconds = state["train_seconds"]
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        if not keep_lr and self.opts.lr != self.scheduler.base_lrs[0]:
            # An explicit --lr on resume re-bases the schedule: the same shape, a new peak.
            logger.info("re-basing peak lr %.2e -> %.2e", self.scheduler.base_lrs[0], self.opts.lr)
            self.scheduler.base_lrs = [self.opts.lr for _ in self.optimizer.param_groups]
            factor = inverse_sqrt(self.opts.warmup, self.opts.schedule_offset)(self.step)
            for group in self.optimizer.param_groups:
                group["initial_lr"] = self.opts.lr
                group["lr"] = self.opts.lr * factor
        logger.info("resumed at step %d (epoch %d, batch %d, best dev BLEU %.2f)",
                    self.step, self.epoch, self.batch_pos, self.best_bleu)

    # -- model selection -----------------------------------------------------------------
    def evaluate_and_select(self) -> None:
        from .evaluate import score, translate

        subset = self.dev_pairs[: self.opts.dev_subset]
        hyps = translate(self.model, self.tok, [p.en for p in subset])
        bleu, chrf = score(hyps, [p.zh for p in subset])
        self.model.train()
        entry = {"step": self.step, "epoch": self.epoch, "minutes": round(self.train_seconds / 60, 1),
                 "dev_subset_bleu": round(bleu, 2), "dev_subset_chrf": round(chrf, 2)}
        self.history.append(entry)
        if bleu > self.best_bleu:
            self.best_bleu = bleu
            torch.save(self.model.state_dict(), self.best_path)
        logger.info("dev subset: %s (best BLEU %.2f)  e.g. %s", entry, self.best_bleu, hyps[:2])

    # -- the loop ------------------------------------------------------------------------
    def loss(self, batch):
        input_ids, mask, dec_in, labels = batch
        logits = self.model(input_ids=input_ids, attention_mask=mask, decoder_input_ids=dec_in).logits
        return F.cross_entropy(
            logits.view(-1, logits.size(-1)), labels.view(-1),
            ignore_index=-100, label_smoothing=self.opts.label_smoothing,
        ), int(labels.ne(-100).sum())

    def train(self) -> None:
        opts = self.opts
        self.model.train()
        start = time.monotonic()
        last_ckpt = start
        log_tokens, log_loss, log_t = 0, 0.0, time.monotonic()
        stop = False
        while not stop:
            # The batch order of an epoch depends only on (seed, epoch), so resume can skip ahead.
            batches = make_batches(self.encoded, opts.max_tokens, random.Random(opts.seed * 1000 + self.epoch))
            while self.batch_pos < len(batches):
                batch = collate(self.encoded, batches[self.batch_pos], self.pad)
                loss, n_tok = self.loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), opts.clip_norm)
                self.optimizer.step()
                self.scheduler.step()
                self.step += 1
                self.batch_pos += 1
                log_tokens += n_tok
                log_loss += loss.item() * n_tok
                now = time.monotonic()
                if self.step % 100 == 0:
                    logger.info("step %d epoch %d lr %.2e loss %.3f  %.0f tgt tok/s", self.step, self.epoch,
                                self.scheduler.get_last_lr()[0], log_loss / log_tokens, log_tokens / (now - log_t))
                    log_tokens, log_loss, log_t = 0, 0.0, now
                out_of_time = now - start >= opts.max_minutes * 60
                out_of_steps = opts.max_steps and self.step >= opts.max_steps
                if out_of_time or out_of_steps or now - last_ckpt >= opts.checkpoint_minutes * 60:
                    self.train_seconds += now - last_ckpt
                    self.evaluate_and_select()
                    self.save_checkpoint()
                    last_ckpt = time.monotonic()
                    log_t = last_ckpt
                    if out_of_time or out_of_steps:
                        stop = True
                        break
            if not stop:
                self.epoch += 1
                self.batch_pos = 0
