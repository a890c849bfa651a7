"""What a user brings to docs/bring-your-own-models.md's walkthrough, built small: a base model folder (a tiny
Llama with its own tokenizer and random weights), a PEFT LoRA adapter on every layer of it, and a text file of
blank-line paragraphs. `python -m tests.byom_pair DIR` writes them for a try by hand."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from jobs.train_family import train_tokenizer
from scd.data import demo_data


def build(root: Path) -> dict[str, Path]:
    """{'base', 'adapter', 'text'}: the folders and file, under root."""
    base, adapter, text = root / "models" / "my-base", root / "adapters" / "support", root / "data" / "support.txt"
    docs = demo_data.facts_texts(400, seed=5)
    tok = train_tokenizer(docs, 400)
    tok.save_pretrained(base)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(base)

    from peft import LoraConfig, get_peft_model
    peft = get_peft_model(LlamaForCausalLM.from_pretrained(base), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:                                   # LoRA starts as the identity; move it
                p.normal_(std=0.2)
    peft.save_pretrained(str(adapter))
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    acfg["base_model_name_or_path"] = str(base)
    (adapter / "adapter_config.json").write_text(json.dumps(acfg, indent=2))

    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text("\n\n".join(docs) + "\n")
    return {"base": base, "adapter": adapter, "text": text}


if __name__ == "__main__":
    for k, v in build(Path(sys.argv[1])).items():
        print(f"{k}: {v}")
