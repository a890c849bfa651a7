"""The `calibration:` section of a deployment config: every fit setting (scd.settings.CalibConfig) plus what the
calibration job needs around the fit, and which of them a specialist may set for its own pair (PAIR_DATA)."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from scd.settings import EXACT_DTYPES, CalibConfig

# besides fit settings, a specialist may calibrate on text of its own, choose its plans on more validation
# samples, and have its own bound and exact-plan wire form (what it may be served at differs per specialist;
# the deployment's gate and budgets do not)
PAIR_DATA = {"text_file", "val", "max_kl", "max_kl_ratio", "bound_noise_z", "max_consumer_prefill_ratio",
             "min_retained_gain", "exact_dtype", "exact_step", "entries", "stops", "tails", "selective",
             "selector_samples", "entry_train_samples", "entry_train_epochs", "entry_train_lr"}


class CalibrationSettings(CalibConfig):
    """The `calibration:` section: every fit setting (scd.settings.CalibConfig, one set of defaults) plus
    what the calibration job needs around the fit."""
    prefixes: int = Field(128, ge=1, description="calibration prefixes per pair")
    val: int = Field(12, ge=1, description="validation samples for the layer policy")
    heldout: int = Field(48, ge=1, description="held-out samples for the published metrics")
    prefix_tokens: int = Field(160, ge=8, description="tokens per calibration prefix")
    gate_vs_raw_kv: float = Field(1.0, ge=0, description=(
        "quality gate: publish only if held-out KL(scd) <= this x KL(raw KV reuse), which costs the consumer "
        "nothing either (0 = off)"))
    max_kl: float | None = Field(None, gt=0, description=(
        "an absolute bound besides max_kl_ratio: a plan is chosen, and published, only if its KL (nats per "
        "token) is at most this; where raw KV reuse is itself exact (an aLoRA's prefix) it is the bound alone"))
    exact_plans: bool = Field(True, description=(
        "when the consumer shares layers with the producer exactly (a LoRA on its top layers, a fine-tune with "
        "frozen lower layers: scd.fitting.structure), serve it by an exact plan: the producer's K and V below "
        "an entry layer and its residual there, the consumer's own layers above, chosen under max_kl_ratio and "
        "max_consumer_prefill_ratio; no codes are fitted"))
    exact_dtype: Literal[EXACT_DTYPES + ("auto",)] = Field("bf16", description=(
        "precision of an exact plan's shared K, V and residual on the wire: bf16 is lossless but for its "
        "rounding; int8 (a scale per head_dim values) about halves the bytes; kivi4 (keys in int4 per channel "
        "over 32 tokens, values in int4 per 32 values, the residual in bf16) takes about a third of bf16's; klt "
        "(transform coded: principal axes fitted on the calibration prefixes, one uniform step of exact_step, "
        "zstd) about a fifth at exact_step 0.1; auto measures bf16 and klt and keeps the one with the least "
        "modeled TTFT on the pair's link within the quality bound"))
    exact_step: float = Field(0.1, gt=0, le=4, description=(
        "klt's quantisation step, relative to the root mean square of each layer's K and V coefficients: "
        "halving it adds about one bit per value and quarters the squared error"))
    max_kl_ratio: float = Field(0.2, gt=0, description=(
        "the quality bound a plan is chosen under: validation KL at most this x raw KV reuse's"))
    bound_noise_z: float = Field(1.0, ge=0, description=(
        "the quality bound's margin for the validation samples' noise: a plan's per-sample KLs must be below "
        "max_kl_ratio x raw KV's by at least this many standard errors of the paired differences; 0: the mean "
        "alone, which favours the plan whose validation KL came out low by chance, and reads higher on other text"))
    max_consumer_prefill_ratio: float = Field(0.5, ge=0, le=1, description=(
        "the ceiling on the consumer's compute over the prefix, as a share of its own prefill's layers"))
    min_retained_gain: float | None = Field(None, ge=0, le=1, description=(
        "the quality bound's task figure: a chosen plan keeps at least this share of the specialist's gain over "
        "the base alone on the validation samples (F1 for QA, perplexity for text; unset: KL alone)"))
    serving_tokens: int = Field(2048, ge=0, description=(
        "the prefix length plans are chosen for: each candidate plan (exact plans in each wire form, recompute "
        "blocks) is also timed on one prefix this long (the validation prefixes end to end, at most the "
        "model's context), and the least modeled TTFT is taken at that length; 0: at the calibration prefixes' "
        "length"))
    diagnostics: bool = Field(True, description=(
        "the report's diagnostics: the payload-against-KL grid over ranks, where the error lives, the x_norm "
        "error profile (about a third of a small pair's job); off, the report keeps the held-out table, the "
        "policy's and the levels' figures"))
    recompute_blocks: bool = Field(True, description=(
        "where the fitted codes miss the quality bound, try plans in which the consumer runs its own top layers "
        "from an aligned residual over the codes below (scd.fitting.blocks), within max_consumer_prefill_ratio"))
    entries: list[Annotated[int, Field(ge=1)]] | None = Field(None, min_length=1, description=(
        "recompute blocks: the entry layers tried, each within max_consumer_prefill_ratio (unset: four evenly "
        "spaced up to it); each entry is checkpointed on its own, so adding one measures only that one"))
    stops: list[Annotated[int, Field(ge=2)]] = Field([], description=(
        "recompute blocks: also try each entry with its block ending below the top, at each stop listed: the "
        "consumer runs layers entry..stop-1 only and the codes serve the layers from stop up again (a block where "
        "the error lives); each such block's entry map is trained through it on its own"))
    tails: list[Annotated[int, Field(ge=1)]] = Field([], description=(
        "recompute blocks: also measure each plan (the codes alone, each entry) with the consumer running the "
        "prefix's last k tokens itself through every layer, for each k listed (the continuation reads those "
        "tokens most); a tail chosen is served as the same share k / prefix_tokens of every prefix"))
    selective: list[Annotated[float, Field(gt=0, le=1)]] = Field([0.05, 0.1, 0.2, 0.35], description=(
        "recompute blocks: also measure each plan with the consumer running the share f of the prefix's positions "
        "that its last 16 attend to most (over the rebuilt cache) through every layer, for each f listed "
        "(selective recompute, scd.online.selective), and on QA samples the share its question reads most (the "
        "suffix rule: a request's own tokens); those within max_consumer_prefill_ratio are measured"))
    selector_samples: int = Field(32, ge=0, description=(
        "fit a selector of the positions to recompute on this many windows (half the fine-tuning samples, half "
        "windows of serving_tokens where the texts are that long): a linear score of each position's rebuilt V "
        "and distance from the prefix's end, fitted to the attention the consumer's own continuation pays it "
        "(scd.fitting.selector); each share of `selective` is then measured with the positions it picks too "
        "(no window run to choose them). 0: no selector"))
    entry_train_samples: int = Field(0, ge=0, description=(
        "recompute blocks: train each entry's aligner end to end on this many of the fine-tuning samples (the "
        "consumer's next-token KL, back through its own layers over the codes below; "
        "scd.fitting.blocks.train_entry); 0: the closed form only"))
    entry_train_epochs: int = Field(3, ge=1, description="epochs of entry_train_samples")
    entry_train_lr: float = Field(1e-4, gt=0, description="Adam's learning rate for the entry's training")
    family_vs_pair: float = Field(1.25, ge=0, description=(
        "a family's quality gate besides gate_vs_raw_kv: publish it only if each member's held-out KL under the "
        "family code is <= this x the KL its published pair artifact recorded (a fan-out to the family gets "
        "the family code instead of the pair's; 0 = off)"))
    work_dir: str = Field("runs/calibrate", description="checkpoints of running/finished calibrations (relative to "
                          "the config file's folder)")
    text_file: str | None = Field(None, description=(
        "your own text (UTF-8, paragraphs split on blank lines; the last fifth held out; relative to the config "
        "file's folder) that the pair is calibrated and evaluated on; default: the demo corpora chosen by the "
        "specialist's name (qa*, code*, else the reference manual's prose)"))
