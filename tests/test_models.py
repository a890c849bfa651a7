import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from scd.online.models import IncompatiblePairError, ModelSpec, check_pair, load, load_pair


def _tokenizer(vocab: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w1", pad_token="w0")


def _save(path, model_type: str, seed: int = 0, **over):
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    kw.update(over)
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    _tokenizer(kw["vocab_size"]).save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_local_checkpoints_load_and_pair(tmp_path, model_type):
    a = _save(tmp_path / "a", model_type, 0)
    b = _save(tmp_path / "b", model_type, 1)
    producer, consumer, tok, spec = load_pair(a, b)
    assert spec.model_type == model_type and spec.num_kv_heads == 2 and spec.head_dim == 8
    assert not torch.equal(producer.lm_head.weight, consumer.lm_head.weight)


def test_incompatible_pairs_are_refused_naming_each_mismatch(tmp_path):
    a = _save(tmp_path / "a", "llama")
    b = _save(tmp_path / "b", "llama", num_hidden_layers=3, num_key_value_heads=4, vocab_size=65)
    with pytest.raises(IncompatiblePairError) as e:
        load_pair(a, b)
    msg = str(e.value)
    for needle in ("num_layers: producer=2 consumer=3", "num_kv_heads: producer=2 consumer=4",
                   "vocab_size: producer=64 consumer=65", "tokenizer"):
        assert needle in msg, f"{needle!r} not in {msg!r}"
    q = _save(tmp_path / "q", "qwen2")
    with pytest.raises(IncompatiblePairError, match="model_type: producer='llama' consumer='qwen2'"):
        load_pair(a, q)


def test_unsupported_architecture_and_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing does not exist"):
        load(tmp_path / "nothing")
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=10)
    with pytest.raises(IncompatiblePairError, match="not supported"):
        ModelSpec.from_config(cfg)
    spec = ModelSpec("llama", 2, 4, 2, 8, 32, 64, 10000.0)
    check_pair(spec, spec)


def test_scd_core_imports_without_ray_fastapi_or_distributed():
    # torch itself loads torch.distributed on import, so that one is checked in the source: no scd module
    # may import it. ray and fastapi are checked at run time too.
    import ast
    import pathlib
    banned = ("ray", "fastapi", "torch.distributed", "starlette")
    for path in pathlib.Path(__file__).resolve().parents[1].joinpath("scd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            hits = [n for n in names if any(n == b or n.startswith(b + ".") for b in banned)]
            assert not hits, f"{path.name} imports {hits}"
    code = ("import sys, scd.fitting.calibrate, scd.evaluation.evaluate, scd.evaluation.methods, scd.online.codec, "
            "scd.fitting.policy, scd.online.artifacts;"
            "bad = [m for m in ('ray', 'fastapi') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, f"scd pulled in {r.stdout.strip()} {r.stderr[-500:]}"


def test_a_model_loaded_with_stderr_not_a_terminal_draws_no_loading_bar():
    """A job's or an actor's stderr is a log file, which keeps each update of transformers' bar as a line:
    `load` turns the bar off there (a process on a terminal keeps it)."""
    from tests.conftest import DEMO
    code = ("import sys; from scd.online.models import load\n"
            f"load({str(DEMO / 'qa')!r}); load({str(DEMO / 'base')!r})\n"
            "from transformers import AutoModelForCausalLM\n"
            f"AutoModelForCausalLM.from_pretrained({str(DEMO / 'base')!r})\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "Loading weights" not in r.stderr, r.stderr[-1500:]
    bare = subprocess.run([sys.executable, "-c", code.split("\n", 2)[2]], capture_output=True, text=True)
    assert "Loading weights" in bare.stderr, f"transformers drew no bar of its own: {bare.stderr[-500:]}"


def test_the_processes_that_only_forward_requests_load_no_torch():
    """The router, the Serve replicas' shims, the producer pool, the registry and the adapter book forward
    requests, create or name actors and read small files: their modules, the messages they unpickle, and the
    router's tokenizer and context length load no torch (about 2 s of CPU and 200 MB in each such process)."""
    from tests.conftest import DEMO
    code = ("import sys, serve_app.router, serve_app.specialist, actors.producer_pool, actors.registry, "
            "actors.adapter_book, actors.messages, engines.interface, scd.online.api\n"
            "from scd.online.model_files import context_length, load_tokenizer\n"
            f"ids = load_tokenizer({str(DEMO / 'base')!r}).encode('Where does Tilda live?')\n"
            f"n = context_length({str(DEMO / 'base')!r})\n"
            "bad = [m for m in ('torch', 'peft', 'transformers.models.auto') if m in sys.modules]\n"
            "print(bad, len(ids), n); sys.exit(1 if bad or not ids or n < 1 else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, f"loaded {r.stdout.strip()} {r.stderr[-1500:]}"


def test_the_routers_tokenizer_gives_the_engines_ids_and_context_length():
    """load_tokenizer (no torch) against AutoTokenizer (what a model load uses): the same ids, special tokens
    and chat template on the demo family and, where it is built, the real one."""
    from transformers import AutoTokenizer

    from jobs.fetch_family import built
    from scd.online.model_files import context_length, load_tokenizer
    from tests.conftest import DEMO
    real = built("smollm2")
    texts = ["Question: Where does Tilda Vance live?\nAnswer:", " x", "\u00fcn\u00efc\u00f6d\u00e9\t\ttabs  ",
             "<|im_start|>user\nhi<|im_end|>", ""]
    chat = [{"role": "user", "content": "Who keeps bees?"}]
    for folder in [DEMO / "base", *([real] if real else [])]:
        ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder, local_files_only=True)
        for t in texts:
            assert ours.encode(t) == auto.encode(t), (folder, t, ours.encode(t), auto.encode(t))
        assert (ours.eos_token_id, ours.bos_token_id, ours.chat_template) == \
            (auto.eos_token_id, auto.bos_token_id, auto.chat_template), folder
        if auto.chat_template:
            assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
                auto.apply_chat_template(chat, add_generation_prompt=True), folder
        assert context_length(folder) == AutoConfig.from_pretrained(folder).max_position_embeddings, folder


def test_imports_run_one_way_online_evaluation_fitting_and_serving_never_imports_fitting():
    """The layering the README's layout table states, checked on every import statement (lazy ones too)."""
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[1]
    forbidden = {"scd/online": ("scd.fitting", "scd.evaluation", "scd.data", "jobs", "cli", "tools"),
                 "scd/evaluation": ("scd.fitting", "scd.data", "jobs", "cli", "tools"),
                 "scd/data": ("scd.fitting", "jobs", "cli", "tools"),
                 "scd/fitting": ("jobs", "cli", "tools"),
                 "artifacts_store": ("scd.fitting", "scd.evaluation", "jobs", "cli"),
                 "serve_app": ("scd.fitting", "scd.evaluation", "jobs", "cli"),
                 "jobs": ("cli", "tools")}
    checked = 0
    for folder, banned in forbidden.items():
        for path in (root / folder).rglob("*.py"):
            checked += 1
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                hits = [n for n in names if any(n == b or n.startswith(b + ".") for b in banned)]
                assert not hits, f"{path.relative_to(root)} imports {hits}: {folder}/ must not import {banned}"
    assert checked > 40, f"only {checked} files checked: the folders moved?"


def test_the_fitting_stages_import_one_another_without_a_cycle():
    """scd/fitting's modules form a DAG (lazy imports included): a stage imports what it builds on, never back."""
    import ast
    import pathlib
    folder = pathlib.Path(__file__).resolve().parents[1] / "scd" / "fitting"
    graph = {}
    for path in folder.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            deps |= {n.split(".")[2] for n in names if n.startswith("scd.fitting.")}
        graph[path.stem] = deps - {path.stem}
    done, stack = set(), []

    def visit(m):
        assert m not in stack, f"import cycle in scd/fitting: {' -> '.join(stack[stack.index(m):] + [m])}"
        if m in done:
            return
        stack.append(m)
        for d in graph.get(m, ()):
            visit(d)
        stack.pop()
        done.add(m)
    for m in graph:
        visit(m)
    assert {"calibrate", "finetune", "traces"} <= set(graph), sorted(graph)
