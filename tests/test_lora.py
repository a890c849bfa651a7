"""LoRA specialists: an adapter folder as a consumer (merged at load, fingerprinted by base + adapter), and
the training job's chat data and resumable checkpoints, on a tiny random base with a ChatML template."""
import json
import random
import shutil
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from artifacts_store.fingerprints import Fingerprints
from jobs import train_lora
from jobs.train_family import train_tokenizer
from scd.online.model_files import is_adapter
from scd.online.models import adapter_digest, load
from tests.conftest import DEMO

SMOLLM2_ADAPTERS = DEMO / "smollm2"      # the real family's committed specialists (checked without the base)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Llama base folder with a byte-level BPE tokenizer, ChatML special tokens and a chat template."""
    from scd.data import demo_data
    path = tmp_path_factory.mktemp("base")
    tok = train_tokenizer(demo_data.facts_texts(40, 0) + ["Answer the question with words copied from notes?"], 400)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _adapter(base_path, out, seed=0, name_base=True):
    from peft import LoraConfig, get_peft_model
    model = LlamaForCausalLM.from_pretrained(base_path)
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj", "v_proj", "up_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:                                   # LoRA starts as the identity; move it
                p.normal_(std=0.5)
    peft.save_pretrained(str(out))
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(base_path) if name_base else "someone/remote-model"
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return peft.eval()


def test_an_adapter_folder_loads_merged_and_is_fingerprinted_by_base_and_adapter(base, tmp_path):
    peft = _adapter(base, tmp_path / "a")
    assert is_adapter(tmp_path / "a") and not is_adapter(base)
    model, tok, spec = load(tmp_path / "a")
    ids = torch.randint(5, len(tok), (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = (model(input_ids=ids).logits - peft(input_ids=ids).logits).abs().max().item()
        plain = (LlamaForCausalLM.from_pretrained(base)(input_ids=ids).logits - peft(input_ids=ids).logits).abs().max()
    assert err < 1e-4, f"merged adapter differs from the PEFT model by {err:.2e}"
    assert plain > 1e-2, "the adapter must change the model, or this test proves nothing"
    assert spec.num_layers == 2 and tok.chat_template == CHATML
    fp = Fingerprints.of(consumer=model).consumer
    assert fp.weights_digest == model.scd_weights_digest
    _adapter(base, tmp_path / "b", seed=1)
    other, _, _ = load(tmp_path / "b")
    assert adapter_digest(tmp_path / "a") != adapter_digest(tmp_path / "b")
    assert Fingerprints.of(consumer=other).consumer.weights_digest != fp.weights_digest
    again, _, _ = load(tmp_path / "a")
    assert again.scd_weights_digest == fp.weights_digest, "the same base + adapter must fingerprint the same"


def test_an_adapter_whose_base_is_not_local_needs_the_base_named(base, tmp_path):
    _adapter(base, tmp_path / "a", name_base=False)
    with pytest.raises(FileNotFoundError, match="someone/remote-model.*base"):
        load(tmp_path / "a")
    model, _, _ = load(tmp_path / "a", base=base)
    assert model.config.num_hidden_layers == 2
    with pytest.raises(FileNotFoundError, match="nothing-here does not exist"):
        load(tmp_path / "nothing-here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a model folder .* nor a PEFT adapter"):
        load(tmp_path / "empty")


def test_a_pair_whose_adapter_names_a_hub_base_merges_it_into_the_producer_and_says_so(base, tmp_path):
    """Adapters usually name their base by hub id: with the producer given, that is the base to merge into (the
    log says so); a producer the adapter's weights do not fit is refused in one line, and the scd command
    answers a user's mistake with one line and exit code 2, never a traceback."""
    import subprocess
    import sys
    from scd.online.models import IncompatiblePairError, load_pair
    peft = _adapter(base, tmp_path / "a", name_base=False)
    said = []
    _, consumer, tok, _ = load_pair(base, tmp_path / "a", log=said.append)
    assert said and "someone/remote-model" in said[0] and str(base) in said[0], said
    ids = torch.randint(5, len(tok), (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (consumer(input_ids=ids).logits - peft(input_ids=ids).logits).abs().max().item()
    assert err < 1e-4, f"merged into the producer, the adapter differs from the PEFT model by {err:.2e}"
    wide = tmp_path / "wide"                                  # same tokenizer, other shapes
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=12)).save_pretrained(wide)
    tok.save_pretrained(wide)
    with pytest.raises(IncompatiblePairError, match="does not fit base"):
        load_pair(wide, tmp_path / "a", log=said.append)
    r = subprocess.run([sys.executable, "-m", "cli.main", "eval", "--producer", str(wide), "--consumer",
                        str(tmp_path / "a"), "--samples", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "does not fit base" in r.stderr, r.stderr[-2000:]


def test_qa_conversations_score_only_the_answers(base):
    tok = AutoTokenizer.from_pretrained(base)
    ids, labels = train_lora.qa_conversation(tok, random.Random(3), 4096)
    assert len(ids) == len(labels)
    scored = [i for i, y in zip(ids, labels) if y != -100]
    text = tok.decode(scored)
    assert text.count("<|im_end|>") >= 3, text                 # one end of turn per answer
    assert "<|im_start|>" not in text and "Notes" not in text, text
    assert tok.decode(ids).startswith("<|im_start|>system\nAnswer the question"), tok.decode(ids[:20])


def test_lora_training_resumes_to_the_same_adapter(base, tmp_path):
    recipe = replace(train_lora.RECIPES["qa"], steps=4, batch=2, seq_len=1024)
    quiet = dict(progress=False, log=lambda s: None, checkpoint_every=2)
    train_lora.train("qa", str(base), tmp_path / "whole", recipe, tmp_path / "w1", **quiet)
    train_lora.train("qa", str(base), tmp_path / "half", replace(recipe, steps=2), tmp_path / "w2", **quiet)
    shutil.rmtree(tmp_path / "half")
    train_lora.train("qa", str(base), tmp_path / "resumed", recipe, tmp_path / "w2", **quiet)
    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "whole" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and a
    err = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    moved = max(a[k].float().abs().max().item() for k in a if "lora_B" in k)
    assert moved > 0, "training must move lora_B off zero"
    assert err < 1e-2 * moved, f"resumed adapter differs from an unbroken run by {err:.2e} (weights ~{moved:.2e})"
    rec = json.loads((tmp_path / "resumed" / "scd_train.json").read_text())
    assert len(rec["losses"]) == 4 and rec["recipe"]["steps"] == 4
    model, _, _ = load(tmp_path / "resumed")                    # the written folder is a loadable consumer
    assert model.config.num_hidden_layers == 2


def test_qa_samples_of_a_chat_model_share_the_system_turn_and_ask_in_the_user_turn(base):
    from scd.data.samples import qa_samples
    tok = AutoTokenizer.from_pretrained(base)
    short, long = qa_samples(tok, "heldout", 3, prefix_tokens=80), qa_samples(tok, "heldout", 3, prefix_tokens=400)
    for s in short + long:
        prefix, question = tok.decode(s.prefix), tok.decode(s.question)
        assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n"), prefix[-40:]
        assert question.startswith("<|im_start|>user\n") and question.endswith("<|im_start|>assistant\n"), question
        assert s.answer in prefix and tok.decode(s.cont[len(s.question):]) == s.answer
    mean = lambda ss: sum(len(s.prefix) for s in ss) / len(ss)  # noqa: E731
    assert mean(long) > 2 * mean(short), "prefix_tokens must size the documents"


def test_fine_tuning_samples_of_a_chat_qa_family_ask_several_questions_about_one_prefix(base):
    from scd.data.samples import tune_samples
    tok = AutoTokenizer.from_pretrained(base)
    got = tune_samples("qa", tok, 3, prefix_tokens=200)
    assert len(got) == 3
    for s in got:
        prefix, cont = tok.decode(s.prefix), tok.decode(s.cont)
        assert prefix.startswith("<|im_start|>system\n") and prefix.endswith("<|im_end|>\n"), prefix[-40:]
        turns = cont.split("<|im_start|>user\n")[1:]
        assert len(turns) == 4, cont
        for turn in turns:                        # every answer is a span of the notes, closed by its end of turn
            question, answer = turn.split("<|im_end|>\n<|im_start|>assistant\n")
            assert answer.endswith("<|im_end|>\n") and answer[:-len("<|im_end|>\n")] in prefix, turn
    assert got[0].question is None              # not a single-question sample (those stay for policy and evaluation)


def test_demo_prompts_of_a_chat_family_share_the_system_turn(base):
    from cli.demo import demo_prompts
    tok = AutoTokenizer.from_pretrained(base)
    prefix, suffixes = demo_prompts(tok)
    assert prefix.startswith("<|im_start|>system\nAnswer the question") and prefix.endswith("<|im_end|>\n")
    assert set(suffixes) == {"qa", "code"}
    for s in suffixes.values():
        assert s.startswith("<|im_start|>user\n") and s.endswith("<|im_start|>assistant\n"), s
    plain_prefix, plain = demo_prompts(None)                 # the tiny family keeps its plain text forms
    assert plain_prefix.startswith("Notes:") and set(plain) == {"qa", "prose", "code"}


def test_the_committed_adapters_are_small_and_name_the_fetched_base():
    total = sum(f.stat().st_size for f in SMOLLM2_ADAPTERS.rglob("*") if f.is_file())
    assert total <= 25 * 2**20, f"adapters take {total / 2**20:.1f} MB, the budget is 25 MB together"
    layers = {"code_few": list(range(18, 24)), "qa_top": list(range(22, 30))}
    for name in ("qa", "code", "code_few", "qa_top", "qa_alora"):
        cfg = json.loads((SMOLLM2_ADAPTERS / name / "adapter_config.json").read_text())
        assert cfg["base_model_name_or_path"] == "~/.scd/models/SmolLM2-135M-Instruct"
        assert json.loads((SMOLLM2_ADAPTERS / name / "scd_train.json").read_text())["specialist"] == name
        assert cfg["layers_to_transform"] == layers.get(name), cfg
        # the aLoRA is switched on by the assistant header of SmolLM2's chat template: <|im_start|>assistant\n
        assert cfg.get("alora_invocation_tokens") == ([1, 520, 9531, 198] if name == "qa_alora" else None), cfg


def test_an_lm_recipe_learns_from_the_text_it_names(base):
    """The prose recipe's windows are the reference manual's prose (demo_data.prose_texts), not code."""
    from scd.data import demo_data
    tok = AutoTokenizer.from_pretrained(base)
    x, y, m = train_lora.Batches(tok, train_lora.RECIPES["prose"])(0)
    assert x.shape == (train_lora.RECIPES["prose"].batch, train_lora.RECIPES["prose"].seq_len) and (x == y).all()
    manual = "\n".join(demo_data.prose_texts("train"))
    for row in x:
        piece = max(tok.decode(row).split(tok.eos_token or "\0"), key=len)[2:-2]     # one text's, its ends cut
        assert len(piece) > 100 and piece in manual, piece[:200]
