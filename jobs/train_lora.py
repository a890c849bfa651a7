"""LoRA specialists of a real pretrained base, trained by the project (PEFT; seeded, resumable, progress bar).

    python -m jobs.train_lora --specialist qa          # extractive QA over a notes document, chat template
    python -m jobs.train_lora --specialist code        # Python source of the standard library (LM)
    python -m jobs.train_lora --specialist prose       # the reference manual's prose, code's recipe (LM)

The base is the folder `scd fetch-family smollm2` builds. Each specialist is written as a PEFT adapter
(adapter_config.json + adapter_model.safetensors, stored in bf16 to stay small) whose config names the base
folder, so `scd eval`, `scd calibrate` and `ray_config.yaml` can take the adapter folder as a consumer and merge
it into the base at load (scd.online.models.load). A `scd_train.json` beside it records the recipe and the loss curve.

Both recipes fine-tune hard on purpose (rank 16, lr 1e-3, constant after a short warm-up): the specialists'
KV caches must drift far enough from the base's that raw KV reuse really hurts, or SCD has nothing to fix.
Every `--checkpoint-every` steps the adapter weights, the optimizer state and the loss curve are written
(safetensors + JSON) under the work folder; a killed run started again with the same arguments resumes there.
The data of step i depends only on (seed, i), so a resumed run sees exactly the batches an unbroken one would.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from scd.data import demo_data

DEFAULT_BASE = "~/.scd/models/SmolLM2-135M-Instruct"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Recipe:
    task: str                    # "qa" (chat, loss on the answers) or "lm" (loss on every token)
    text: str = "code"           # lm: the text it learns (scd.data.demo_data: "code" or "prose")
    rank: int = 16
    alpha: int = 32
    targets: tuple[str, ...] = ALL_LINEAR
    layers: tuple[int, ...] | None = None   # None = every layer
    lr: float = 1e-3
    warmup: int = 10
    steps: int = 150
    batch: int = 4
    seq_len: int = 256           # lm: window length; qa: cap on a conversation's length
    seed: int = 0
    turns: int = 6               # qa: questions per conversation
    alora: str | None = None     # an activated LoRA: the text whose tokens switch it on (PEFT's
                                 # alora_invocation_tokens); the cache of everything before them is the base's


RECIPES = {
    # attention-only LoRA: changes what the specialist reads out of the notes and how it writes its own KV
    "qa": Recipe(task="qa", targets=("q_proj", "k_proj", "v_proj", "o_proj"), steps=150, seq_len=640),
    # every linear module of every layer: a domain shift that moves the whole residual stream. The base
    # already knows Python, so a gentler recipe leaves the specialist's cache close to the base's; a high lr
    # for more steps moves it further (raw KV reuse must cost something), and a wider rank at a lower lr
    # moves it less and ends worse than the base on held-out code
    "code": Recipe(task="lm", lr=3e-3, steps=300, seq_len=256),
    # the same domain shift confined to 6 of the 30 layers (18-23; the paper's setting of a fine-tune that
    # moves few layers): layers 0-17 keep the base's KV exactly, layers from 18 on drift
    "code_few": Recipe(task="lm", layers=tuple(range(18, 24)), lr=3e-3, steps=300, seq_len=256),
    # code's recipe on other text (the reference manual's prose): a new every-layer pair that no setting of
    # the project's configs was tuned on, calibrated at a new pair's defaults
    "prose": Recipe(task="lm", text="prose", lr=3e-3, steps=300, seq_len=256),
    # qa's task made to share with its base: every linear module of the top 8 layers only, so
    # layers 0-21 and the residual entering 22 stay the base's exactly
    "qa_top": Recipe(task="qa", layers=tuple(range(22, 30)), steps=150, seq_len=640),
    # qa's task as an activated LoRA: on from the assistant turn's header, so the notes and the question are
    # the base's cache; PEFT switches it on at the last invocation, so each conversation asks one question
    "qa_alora": Recipe(task="qa", targets=("q_proj", "k_proj", "v_proj", "o_proj"), steps=150, seq_len=640,
                       turns=1, alora="<|im_start|>assistant\n"),
}


def qa_conversation(tok, rng: random.Random, seq_len: int, turns: int = 6) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one chat: the notes as the system turn, then several question/answer turns;
    only the assistant's answers are scored. Each turn's tokens are the difference between the rendered
    conversation before and after it, so any chat template that renders prefixes consistently works."""
    doc, qas = demo_data.facts_document(rng, rng.randint(2, 10))
    msgs = [{"role": "system", "content": demo_data.qa_system_prompt(doc)}]
    ids: list[int] = []
    labels: list[int] = []
    rendered = ""
    for q, a in rng.sample(qas, min(len(qas), turns)):
        for role, content, scored in (("user", demo_data.bare_question(q), False), ("assistant", a, True)):
            msgs.append({"role": role, "content": content})
            text = tok.apply_chat_template(msgs, tokenize=False)
            if not text.startswith(rendered):
                raise ValueError("the chat template does not render conversation prefixes consistently")
            piece = tok(text[len(rendered):], add_special_tokens=False)["input_ids"]
            if scored:   # the assistant header is context, the answer and its end-of-turn are the target
                head = tok.apply_chat_template(msgs[:-1], tokenize=False, add_generation_prompt=True)[len(rendered):]
                n_head = len(tok(head, add_special_tokens=False)["input_ids"])
                labels += [-100] * n_head + piece[n_head:]
            else:
                labels += [-100] * len(piece)
            ids += piece
            rendered = text
        if len(ids) >= seq_len:
            break
    if all(y == -100 for y in labels[:seq_len]):
        raise ValueError(f"seq_len {seq_len} cuts the conversation before its first answer ({len(ids)} tokens)")
    return ids[:seq_len], labels[:seq_len]


class Batches:
    """Batch i is a pure function of (recipe seed, i): resuming at step i replays the same data."""

    def __init__(self, tok, recipe: Recipe):
        self.tok, self.r = tok, recipe
        if recipe.task == "lm":
            eos = tok.eos_token_id if tok.eos_token_id is not None else 0
            ids = []
            texts = {"code": demo_data.code_texts, "prose": demo_data.prose_texts}[recipe.text]("train")
            for t in texts:
                ids += tok(t, add_special_tokens=False)["input_ids"] + [eos]
            self.stream = torch.tensor(ids, dtype=torch.long)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r, rng = self.r, random.Random(f"{self.r.seed}-{step}")
        if r.task == "lm":
            starts = [rng.randrange(len(self.stream) - r.seq_len) for _ in range(r.batch)]
            x = torch.stack([self.stream[s:s + r.seq_len] for s in starts])
            return x, x.clone(), torch.ones_like(x)
        rows = [qa_conversation(self.tok, rng, r.seq_len, r.turns) for _ in range(r.batch)]
        t = max(len(i) for i, _ in rows)
        x = torch.zeros(len(rows), t, dtype=torch.long)
        y = torch.full((len(rows), t), -100, dtype=torch.long)
        m = torch.zeros(len(rows), t, dtype=torch.long)
        for b, (i, l) in enumerate(rows):               # right padding: positions stay 0..n-1 for every row
            x[b, :len(i)], y[b, :len(l)], m[b, :len(i)] = torch.tensor(i), torch.tensor(l), 1
        return x, y, m


def _work_dir(root: Path, name: str, recipe: Recipe, base_digest: str) -> Path:
    """Keyed by everything but the step count: a run asked for more steps continues a shorter one."""
    key = json.dumps({"name": name, "recipe": {**asdict(recipe), "steps": None}, "base": base_digest}, sort_keys=True)
    return root / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"


def _save_checkpoint(work: Path, model, opt, step: int, losses: list[float]) -> None:
    from peft import get_peft_model_state_dict
    work.mkdir(parents=True, exist_ok=True)
    tensors = {f"adapter.{k}": v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    state = opt.state_dict()
    for i, s in state["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[f"opt.{i}.{k}"] = s[k].contiguous()
    tmp = work / "checkpoint.tmp"
    save_file(tensors, str(tmp))
    tmp.replace(work / "checkpoint.safetensors")          # the JSON is written second: it marks the step done
    (work / "checkpoint.json").write_text(json.dumps({"step": step, "losses": losses,
                                                      "opt_steps": {str(i): float(s["step"]) for i, s in
                                                                    state["state"].items()}}))


def _load_checkpoint(work: Path, model, opt) -> tuple[int, list[float]]:
    from peft import set_peft_model_state_dict
    meta_p, tens_p = work / "checkpoint.json", work / "checkpoint.safetensors"
    if not (meta_p.is_file() and tens_p.is_file()):
        return 0, []
    meta, t = json.loads(meta_p.read_text()), load_file(str(tens_p))
    set_peft_model_state_dict(model, {k[len("adapter."):]: v for k, v in t.items() if k.startswith("adapter.")})
    state = opt.state_dict()
    for i_str, n in meta["opt_steps"].items():
        i = int(i_str)
        state["state"][i] = {"step": torch.tensor(n), "exp_avg": t[f"opt.{i}.exp_avg"],
                             "exp_avg_sq": t[f"opt.{i}.exp_avg_sq"]}
    opt.load_state_dict(state)
    return meta["step"], meta["losses"]


def train(name: str, base: str, out: Path, recipe: Recipe, work_root: Path, checkpoint_every: int = 10,
          progress: bool = True, log=print) -> Path:
    """Train one specialist's adapter into `out` (resuming from `work_root` when a checkpoint exists)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scd.online.models import folder_digest

    base_p = Path(base).expanduser()
    torch.manual_seed(recipe.seed)
    tok = AutoTokenizer.from_pretrained(base_p, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(base_p, dtype=torch.float32, local_files_only=True)
    invocation = tok(recipe.alora, add_special_tokens=False)["input_ids"] if recipe.alora else None
    cfg = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0, target_modules=list(recipe.targets),
                     layers_to_transform=list(recipe.layers) if recipe.layers else None, task_type="CAUSAL_LM",
                     alora_invocation_tokens=invocation)
    model = get_peft_model(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=0.0)
    work = _work_dir(work_root, name, recipe, folder_digest(base_p))
    start, losses = _load_checkpoint(work, model, opt)
    if start:
        log(f"{name}: resumed from {work} at step {start}")
    batches = Batches(tok, recipe)
    model.train()
    t0 = time.time()
    bar = tqdm(range(start, recipe.steps), desc=f"lora {name}", disable=not progress, initial=start, total=recipe.steps)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = recipe.lr * min(1.0, (step + 1) / recipe.warmup)
        x, y, m = batches(step)
        loss = model(input_ids=x, attention_mask=m, labels=y).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
        if (step + 1) % checkpoint_every == 0 or step + 1 == recipe.steps:
            _save_checkpoint(work, model, opt, step + 1, losses)
    write_adapter(model, out, base, name, recipe, losses, time.time() - t0)
    log(f"{name}: adapter written to {out} (loss {losses[0]:.3f} -> {sum(losses[-10:]) / len(losses[-10:]):.3f})")
    return out


def write_adapter(model, out: Path, base: str, name: str, recipe: Recipe, losses: list[float], seconds: float):
    """PEFT folder with bf16 weights and the base named as given (e.g. under ~), plus the training record."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)          # PEFT's empty model-card template
    w = out / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(str(w)).items()}, str(w))
    cfg_p = out / "adapter_config.json"
    cfg = json.loads(cfg_p.read_text())
    cfg["base_model_name_or_path"] = base
    cfg_p.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    (out / "scd_train.json").write_text(json.dumps({"specialist": name, "recipe": asdict(recipe), "losses": losses,
                                                    "train_seconds": round(seconds, 1)}, indent=1))


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--specialist", choices=sorted(RECIPES), action="append",
                   help="which specialist(s) to train (repeatable; default: all)")
    p.add_argument("--base", default=DEFAULT_BASE, help="the base model folder (from `scd fetch-family`)")
    p.add_argument("--out", default="demo_models/smollm2", help="adapters are written to OUT/<specialist>")
    p.add_argument("--work", default="~/.scd/work/lora", help="checkpoints (resumable)")
    p.add_argument("--steps", type=int, help="override the recipe's step count (smoke runs)")
    p.add_argument("--checkpoint-every", type=int, default=10)
    args = p.parse_args(argv)
    if not (Path(args.base).expanduser() / "config.json").is_file():
        p.error(f"--base {args.base} is not a model folder; build it with `scd fetch-family smollm2`")
    done = []
    for name in args.specialist or sorted(RECIPES):
        recipe = RECIPES[name] if args.steps is None else replace(RECIPES[name], steps=args.steps)
        done.append(train(name, args.base, Path(args.out) / name, recipe, Path(args.work).expanduser(),
                          args.checkpoint_every))
    return done


if __name__ == "__main__":
    main()
