"""Calibration prefixes and evaluation samples for a pair, from the demo corpora or a user's text file."""
from __future__ import annotations

from pathlib import Path

import torch

from scd.data import demo_data
from scd.evaluation.evaluate import Sample


def _ids(tok, text: str) -> torch.Tensor:
    return torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


TOKENS_PER_PERSON = 36      # a person's 3-5 facts in a notes document, in SmolLM2 tokens (measured: 33-38)


def _people(prefix_tokens: int) -> tuple[int, int]:
    """(min, max) persons per notes document so that a chat family's document is about `prefix_tokens` long."""
    lo = max(2, prefix_tokens // TOKENS_PER_PERSON)
    return lo, lo + 2


def qa_samples(tok, split: str, n: int, seed: int = 0, prefix_tokens: int | None = None) -> list[Sample]:
    """Extractive QA samples. With an instruct family's chat template the prefix is the rendered system
    turn holding the notes, the question the rendered user turn and assistant header, the answer the bare
    span, and documents are sized to about `prefix_tokens`; otherwise (the demo family) the plain
    'Notes ... Question: ... Answer: <stem>' form on short documents."""
    chat = demo_data.instruct_chat(tok)
    people = (2, 4)
    if chat and prefix_tokens:
        people = _people(prefix_tokens)
    out = []
    for ex in demo_data.qa_examples(split, n, seed, people):
        if chat:
            system = [{"role": "system", "content": demo_data.qa_system_prompt(ex.document)}]
            user = system + [{"role": "user", "content": demo_data.bare_question(ex.question)}]
            prefix_text = tok.apply_chat_template(system, tokenize=False)
            full = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
            prefix, q, answer = _ids(tok, prefix_text), _ids(tok, full[len(prefix_text):]), ex.answer.strip()
            a = _ids(tok, answer)
        else:
            prefix, q, a, answer = _ids(tok, ex.document), _ids(tok, ex.question), _ids(tok, ex.answer), ex.answer.strip()
        out.append(Sample(prefix, torch.cat([q, a]), q, answer))
    return out


def qa_chat_conversations(tok, split: str, n: int, seed: int = 0, prefix_tokens: int = 512,
                          turns: int = 4) -> list[Sample]:
    """Samples for a chat QA specialist with several retrievals per prefix: the notes' system turn is the
    prefix (as in qa_samples) and the continuation is `turns` question/answer turns about them, rendered
    with the chat template, each answer closed by its end of turn. Fine-tuning on them trains each rebuilt
    cache on several answers instead of one question and one answer (answers are ~15% of a single-question
    continuation's tokens)."""
    out = []
    for doc, qas in demo_data.qa_conversations(split, n, seed, _people(prefix_tokens), turns):
        msgs = [{"role": "system", "content": demo_data.qa_system_prompt(doc)}]
        prefix_text = tok.apply_chat_template(msgs, tokenize=False)
        for q, a in qas:
            msgs += [{"role": "user", "content": demo_data.bare_question(q)}, {"role": "assistant", "content": a}]
        full = tok.apply_chat_template(msgs, tokenize=False)
        if not full.startswith(prefix_text):
            raise ValueError("the chat template does not render the system turn as a prefix of the conversation")
        out.append(Sample(_ids(tok, prefix_text), _ids(tok, full[len(prefix_text):])))
    return out


def lm_samples(tok, texts: list[str], n: int, prefix_tokens: int, cont_tokens: int, seed: int = 0) -> list[Sample]:
    """Windows of `prefix_tokens` + `cont_tokens` from texts long enough to hold one, chosen with a seed."""
    need = prefix_tokens + cont_tokens
    streams = [ids for ids in (_ids(tok, t) for t in texts) if len(ids) >= need]
    if not streams:
        raise ValueError(f"no text holds {need} tokens; lower --prefix-tokens or give longer text")
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = streams[int(torch.randint(len(streams), (1,), generator=g))]
        s = int(torch.randint(len(ids) - need + 1, (1,), generator=g))
        out.append(Sample(ids[s:s + prefix_tokens], ids[s + prefix_tokens:s + need]))
    return out


def domain(consumer_name: str) -> str:
    """What a specialist is calibrated and evaluated on: its name up to the first '_' (`code_few`, the code
    specialist that changes few layers, takes the `code` data)."""
    return consumer_name.split("_", 1)[0]


VAL_EVERY = 8      # every 8th training document (or paragraph block of a --text file) holds validation windows


def domain_texts(domain: str, split: str, text_file: str | None = None) -> list[str]:
    """The texts of a split: 'train' (calibration prefixes and fine-tuning samples), 'val' (validation windows:
    documents apart from train's, so that choices made on validation, a rank, a Patch layer, a fine-tuning
    epoch, are not made on the texts that were fitted) or 'heldout' (evaluation)."""
    if text_file:
        p = Path(text_file).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"--text {p}: no such file")
        paras = [t for t in p.read_text(encoding="utf-8", errors="replace").split("\n\n") if t.strip()]
        cut = max(1, len(paras) // 5)                       # last fifth held out
        if split == "heldout":
            return ["\n\n".join(paras[-cut:])]
        train = paras[:-cut]
        val = max(1, len(train) // VAL_EVERY)               # the last eighth of the rest for validation
        return ["\n\n".join(train[-val:] if split == "val" else train[:-val] or train)]
    source = demo_data.code_texts if domain == "code" else demo_data.prose_texts
    if split == "heldout":
        return source("heldout")
    texts = source("train")
    return [t for i, t in enumerate(texts) if (i % VAL_EVERY == VAL_EVERY - 1) == (split == "val")]


def pair_data(consumer_name: str, tok, n_calib: int, n_val: int, n_eval: int, prefix_tokens: int = 160,
              cont_tokens: int = 32, text_file: str | None = None, seed: int = 0):
    """(calibration prefixes, policy validation samples, held-out evaluation samples) for a consumer."""
    data = domain(consumer_name)
    if data == "qa" and not text_file:
        calib = [s.prefix for s in qa_samples(tok, "calib", n_calib, seed, prefix_tokens)]
        return (calib, qa_samples(tok, "val", n_val, seed, prefix_tokens),
                qa_samples(tok, "heldout", n_eval, seed, prefix_tokens))
    calib = [s.prefix for s in lm_samples(tok, domain_texts(data, "train", text_file), n_calib, prefix_tokens, 1, seed)]
    val = lm_samples(tok, domain_texts(data, "val", text_file), n_val, prefix_tokens, cont_tokens, seed + 1)
    return calib, val, lm_samples(tok, domain_texts(data, "heldout", text_file), n_eval, prefix_tokens, cont_tokens,
                                  seed + 2)


def tune_samples(consumer_name: str, tok, n: int, prefix_tokens: int = 160, cont_tokens: int = 32,
                 text_file: str | None = None, seed: int = 0) -> list[Sample]:
    """(prefix, continuation) samples from the training split for end-to-end aligner fine-tuning: QA
    documents with their question and answer (a chat family: several question/answer turns), or text windows."""
    if n <= 0:
        return []
    if domain(consumer_name) == "qa" and not text_file:
        if demo_data.instruct_chat(tok):
            return qa_chat_conversations(tok, "calib", n, seed + 11, prefix_tokens)
        return qa_samples(tok, "calib", n, seed + 11, prefix_tokens)
    return lm_samples(tok, domain_texts(domain(consumer_name), "train", text_file), n, prefix_tokens, cont_tokens,
                      seed + 11)
