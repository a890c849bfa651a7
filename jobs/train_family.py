"""Ray-free training job for the demo model family: a base LM and specialists fine-tuned from it.

    python -m jobs.train_family --out demo_models            # the committed family (~30 min on 2 cores)
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

from jobs import demo_data

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
    base_steps: int = 1400
    base_lr: float = 3e-3
    specialist_steps: int = 700
    specialist_lr: float = 3e-3


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=EOS)


class TokenStream:
    """Samples (batch, seq_len) windows from texts joined by EOS: an endless, seeded language-modelling feed."""

    def __init__(self, tokenizer, texts: list[str], seed: int):
        ids: list[int] = []
        for t in texts:
            ids.extend(tokenizer(t)["input_ids"] + [tokenizer.eos_token_id])
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch: int, seq_len: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.ids) - seq_len - 1, (batch,), generator=self.gen)
        return torch.stack([self.ids[s:s + seq_len] for s in starts.tolist()])  # (B, T)


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


def fit(model, stream: TokenStream, steps: int, lr: float, cfg: TrainConfig, desc: str) -> float:
    """AdamW with linear warm-up then constant lr; returns the mean loss of the last 20 steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    losses = []
    model.train()
    for step in (bar := tqdm(range(steps), desc=desc)):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warm)
        x = stream.batch(cfg.batch, cfg.seq_len)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
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
    args = p.parse_args(argv)
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    if args.tiny:
        cfg.hidden, cfg.layers, cfg.intermediate, cfg.vocab_size, cfg.seq_len, cfg.batch = 64, 2, 128, 512, 64, 4
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
    report = {"config": asdict(cfg), "params": sum(p.numel() for p in base.parameters()), "final_loss": {}}
    report["final_loss"]["base"] = fit(base, TokenStream(tokenizer, texts["base"], cfg.seed), cfg.base_steps,
                                       cfg.base_lr, cfg, "base")
    save(base, tokenizer, out / "base")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    for i, name in enumerate(SPECIALISTS):
        base.load_state_dict(base_state)
        stream = TokenStream(tokenizer, texts[name], cfg.seed + 1 + i)
        report["final_loss"][name] = fit(base, stream, cfg.specialist_steps, cfg.specialist_lr, cfg, name)
        save(base, tokenizer, out / name)
    (out / "family.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report["final_loss"]))
    return report


if __name__ == "__main__":
    main()
