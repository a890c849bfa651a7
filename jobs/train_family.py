"""Ray-free training job for the demo model family: a base LM and specialists fine-tuned from it.

    python -m jobs.train_family --out demo_models            # the committed family
    python -m jobs.train_family --out /tmp/f --base-steps 3 --specialist-steps 2 --tiny   # smoke run

Every model is a Llama decoder (GQA, RoPE) with one shared byte-level BPE tokenizer trained here. The
specialists are fine-tuned hard (high constant learning rate, many steps) so that their KV caches drift
far from the base model's: raw KV reuse must really hurt, or SCD would have nothing to fix.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from scd.data import demo_data

SPECIALISTS = ("qa", "prose", "code")
EOS, PAD = "<|endoftext|>", "<|pad|>"


@dataclass
class TrainConfig:
    out: str = "demo_models"
    seed: int = 0
    vocab_size: int = 2048
    hidden: int = 128
    layers: int = 8
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    seq_len: int = 256
    batch: int = 16
    copy_max_steps: int = 2500
    base_steps: int = 1400
    base_lr: float = 1e-3
    specialist_steps: int = 600
    specialist_lr: float = 3e-3
    qa_steps: int = 1800
    qa_lr: float = 1e-3


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS)
    out.chat_template = demo_data.CHAT_TEMPLATE           # chat in the plain QA form the specialists learned
    return out


class TokenStream:
    """An endless, seeded language-modelling feed of (input ids, labels), each (batch, seq_len).

    Default: random windows of the texts joined by EOS. aligned=True: each row is one text from its start
    (truncated, EOS-padded, padding not scored), so a document is always seen with its questions.
    """

    def __init__(self, tokenizer, texts: list[str], seed: int, aligned: bool = False):
        eos = tokenizer.eos_token_id
        self.docs = [torch.tensor(tokenizer(t)["input_ids"] + [eos], dtype=torch.long) for t in texts]
        self.ids = torch.cat(self.docs)
        self.aligned, self.eos = aligned, eos
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.aligned:
            starts = torch.randint(0, len(self.ids) - seq_len - 1, (batch,), generator=self.gen)
            x = torch.stack([self.ids[s:s + seq_len] for s in starts.tolist()])
            return x, x
        x = torch.full((batch, seq_len), self.eos, dtype=torch.long)
        labels = torch.full((batch, seq_len), -100, dtype=torch.long)
        for row, i in enumerate(torch.randint(0, len(self.docs), (batch,), generator=self.gen).tolist()):
            d = self.docs[i][:seq_len]
            x[row, :len(d)] = labels[row, :len(d)] = d
        return x, labels


def corpus(name: str, seed: int, n_facts: int) -> list[str]:
    """Training texts for one member of the family ('base' or a specialist name)."""
    rng = random.Random(f"{name}-{seed}")
    if name == "base":
        return demo_data.prose_texts("train") + demo_data.code_texts("train") + demo_data.facts_texts(n_facts, seed)
    if name == "qa":
        return [demo_data.qa_training_text(rng) for _ in range(n_facts)]
    if name == "prose":
        return demo_data.prose_texts("train")
    if name == "code":
        return demo_data.code_texts("train")
    raise ValueError(f"unknown family member {name!r}")


class MixedStream:
    """Rows from several streams in fixed proportions: (stream, rows per batch) pairs, rows summing to batch."""

    def __init__(self, parts: list[tuple[TokenStream, int]]):
        self.parts = parts

    def batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ls = zip(*(s.batch(n, seq_len) for s, n in self.parts))
        return torch.cat(xs), torch.cat(ls)


class CopyTask:
    """Random token sequences shown twice: the second half is predictable only by looking back."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.gen = vocab, torch.Generator().manual_seed(seed)

    def batch(self, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randint(100, self.vocab, (batch, seq_len // 2), generator=self.gen)
        x = torch.cat([x, x], 1)
        return x, x

    @torch.no_grad()
    def copy_loss(self, model, seq_len: int) -> float:
        """Loss on the repeated half; near 0 once induction heads exist, ~log(vocab) before."""
        x, _ = self.batch(8, seq_len)
        logits = model(input_ids=x).logits[:, seq_len // 2:-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, seq_len // 2 + 1:].reshape(-1)).item()


def grow_induction_heads(model, cfg: TrainConfig, vocab: int, lr: float) -> int:
    """Train on the copy task until copying works (loss on the repeat < 1 nat) or the step cap.

    Induction heads form in a sudden phase change whose onset varies by hundreds of steps across seeds, so
    the phase runs to a measured criterion instead of a fixed step count. Returns steps used."""
    task = CopyTask(vocab, cfg.seed)
    stopped_at = [cfg.copy_max_steps]

    def copying(step: int) -> bool:
        if step % 50 == 49 and task.copy_loss(model, 128) < 1.0:
            stopped_at[0] = step + 1
            return True
        return False

    fit(model, task, cfg.copy_max_steps, lr, cfg, "induction", seq_len=128, stop=copying)
    return stopped_at[0]


@torch.no_grad()
def qa_exact_match(model, tokenizer, n: int = 40) -> float:
    """Greedy answers to held-out questions; the fraction that equals the gold span."""
    hits = 0
    for ex in demo_data.qa_examples("heldout", n):
        ids = tokenizer(ex.document + ex.question, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        hits += tokenizer.decode(out[0, ids.shape[1]:]).split("\n")[0].strip() == ex.answer.strip()
    return hits / n


def fit(model, stream, steps: int, lr: float, cfg: TrainConfig, desc: str, seq_len: int | None = None,
        stop=None) -> float:
    """AdamW with linear warm-up then constant lr; returns the mean loss of the last 20 steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, min(steps // 20, 100))
    losses = []
    model.train()
    for step in (bar := tqdm(range(steps), desc=desc)):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warm)
        x, labels = stream.batch(cfg.batch, seq_len or cfg.seq_len)
        loss = model(input_ids=x, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if stop is not None and stop(step):
            break
    model.eval()
    tail = losses[-20:]
    return sum(tail) / len(tail)


def save(model, tokenizer, path: Path) -> None:
    """HF format in bf16 (keeps the committed family small); loaders upcast to fp32 for CPU compute."""
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    model.to(torch.float32)
    tokenizer.save_pretrained(path)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in asdict(TrainConfig()).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=type(v), default=v)
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide family for smoke tests")
    p.add_argument("--reuse-base", action="store_true", help="keep OUT/base if this job trained it with the same config")
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    if args.tiny:
        cfg.hidden, cfg.layers, cfg.intermediate, cfg.vocab_size, cfg.seq_len, cfg.batch = 64, 2, 128, 512, 64, 4
        cfg.qa_steps = cfg.specialist_steps
    n_facts = 3000 if not args.tiny else 50
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)

    texts = {name: corpus(name, cfg.seed, n_facts) for name in ("base",) + SPECIALISTS}
    sample = [t for ts in texts.values() for t in ts[:400]]
    tokenizer = train_tokenizer(sample, cfg.vocab_size)

    mcfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
                       head_dim=cfg.hidden // cfg.heads, max_position_embeddings=4096, rope_theta=10000.0,
                       tie_word_embeddings=True, bos_token_id=tokenizer.eos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    base = LlamaForCausalLM(mcfg)
    report = {"config": asdict(cfg), "params": sum(p.numel() for p in base.parameters()), "final_loss": {},
              "induction_steps": {}}
    base_dir = out / "base"
    if args.reuse_base and (base_dir / "train_config.json").is_file() and \
            json.loads((base_dir / "train_config.json").read_text()) == asdict(cfg):
        base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        print(f"reusing {base_dir} (trained by this job with the same config)")
    else:
        report["induction_steps"]["base"] = grow_induction_heads(base, cfg, len(tokenizer), cfg.base_lr)
        repeat = max(1, cfg.batch // 4)
        stream = MixedStream([(TokenStream(tokenizer, texts["base"], cfg.seed), cfg.batch - repeat),
                              (TokenStream(tokenizer, demo_data.repeat_texts(n_facts, cfg.seed), cfg.seed), repeat)])
        report["final_loss"]["base"] = fit(base, stream, cfg.base_steps, cfg.base_lr, cfg, "base")
        save(base, tokenizer, base_dir)
        (base_dir / "train_config.json").write_text(json.dumps(asdict(cfg), indent=1))
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    for i, name in enumerate(SPECIALISTS):
        base.load_state_dict(base_state)
        if name == "qa":
            # The base keeps no induction heads through plain-text training (its copy loss is back at
            # chance), and extractive QA is in-context retrieval. So the QA specialist grows them first,
            # then trains on dense QA with a quarter of each batch still copy rows to keep them.
            report["induction_steps"]["qa"] = grow_induction_heads(base, cfg, len(tokenizer), cfg.qa_lr)
            copy = max(1, cfg.batch // 4)
            stream = MixedStream([(TokenStream(tokenizer, texts[name], cfg.seed + 1 + i, aligned=True),
                                   cfg.batch - copy), (CopyTask(len(tokenizer), cfg.seed + 1), copy)])
            report["final_loss"][name] = fit(base, stream, cfg.qa_steps, cfg.qa_lr, cfg, name)
        else:
            stream = TokenStream(tokenizer, texts[name], cfg.seed + 1 + i)
            report["final_loss"][name] = fit(base, stream, cfg.specialist_steps, cfg.specialist_lr, cfg, name)
        if name == "qa":
            report["qa_exact_match"] = {"base": qa_exact_match(LlamaForCausalLM.from_pretrained(out / "base", dtype=torch.float32),
                                                               tokenizer), "qa": qa_exact_match(base, tokenizer)}
            print("held-out QA exact match", report["qa_exact_match"])
        save(base, tokenizer, out / name)
    (out / "family.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("final_loss", "induction_steps", "qa_exact_match") if k in report}))
    return report


if __name__ == "__main__":
    main()
