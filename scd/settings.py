"""Calibration settings: the one schema of what a pair's fit depends on (pydantic, no torch).

Fitting code (scd.fitting.calibrate) takes a CalibConfig; the deployment config's `calibration:` section extends it
(cluster.calibration_settings.CalibrationSettings) and `scd eval`/`scd bench` derive their flags from that, so every
setting has one name, one default and one description.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CODE_DTYPES = ("fp16", "bf16", "int8", "int4", "mixed")   # wire precisions of codes (scd.online.codec)
# an exact plan's shared K, V and residual may also travel as "kivi4": keys in int4 per channel over groups of
# 32 tokens (KIVI), values in int4 per group of 32 values, the residual in bf16; or as "klt": transform coded
# (scd.online.klt: each layer's K and V in its own principal axes, one uniform step, integer symbols that zstd
# entropy-codes), the residual in bf16
EXACT_DTYPES = CODE_DTYPES + ("kivi4", "klt")
# selective recompute's attention rule: the prefix's last positions whose attention picks the positions the
# consumer recomputes (scd.online.selective.attention); they run twice, so a plan's count includes them again
# (select_window_pass)
SELECT_WINDOW = 16


def select_window_pass(selected: int) -> int:
    """The positions the attention rule runs first to choose, for a selection of `selected` (its window among
    them): the window, or none when the selection is the window alone (its one pass is then the repair)."""
    return SELECT_WINDOW if selected > SELECT_WINDOW else 0


class CalibConfig(BaseModel):
    """Everything a pair's fit depends on: the one schema of calibration settings. The deployment config's
    `calibration:` section extends it (cluster.calibration_settings.CalibrationSettings: how many prefixes, the
    quality gate, where checkpoints go) and `scd eval`/`scd bench` derive their flags from that.

    The defaults are the codes every shipped config gives its pairs, so a new pair (`scd eval --producer P
    --consumer C`) gets them without flags: one hidden-state code per token for each group of 6 adjacent layers,
    its rank chosen under a payload budget of 0.15 of the raw KV, sent in mixed int8/int4, with Patch codes of
    rank 128. The per-head K/V codes (reuse_source kv, r_k, r_v) are the other form (docs/method.md)."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    r_k: int = Field(8, ge=1, description="rank of the per-head key codes (reuse_source kv)")
    r_v: int = Field(12, ge=1, description="rank of the per-head value codes (reuse_source kv)")
    r_h: int = Field(128, ge=1, description="rank of the Patch layers' hidden-state codes (at most the hidden size)")
    ridge: float = Field(1e-4, ge=0, description="ridge of the producer-side encoders, relative to the mean variance")
    aligner_width: int = Field(128, ge=1, description="hidden width of the Patch aligners' MLP")
    aligner_epochs: int = Field(100, ge=1, description="training epochs of each Patch aligner")
    aligner_context: int = Field(8, ge=1, description="codes per Patch aligner input (1 = the paper's per-token aligner)")
    aligner_window: int = Field(8, ge=1, description="per-position width of the squeezed features the window reads")
    aligner_tokens: int = Field(32, ge=0, description="width of the aligner's token features from the consumer's "
                                                      "layer-0 input (0 = none)")
    aligner_loss: Literal["kv", "x"] = Field("kv", description="aligner fit: regenerated K/V error or x_norm error")
    aligner_prefixes: int = Field(0, ge=0, description=(
        "the Patch aligners train on the first this many calibration prefixes (0 = all): their training time "
        "grows with the rows, while the Reuse codes, a closed-form fit, keep every prefix"))
    pool: int = Field(4, ge=1, description="Patch candidates: the most sensitive layers kept for the greedy policy")
    finetune_samples: int = Field(512, ge=0, description="(prefix, continuation) samples for end-to-end fine-tuning "
                                                         "on the consumer's next-token KL (0 = off)")
    finetune_epochs: int = Field(3, ge=1, description="epochs of end-to-end fine-tuning")
    finetune_tokens: int = Field(32, ge=2, description="continuation tokens of each text-window fine-tuning sample "
                                                       "(LM specialists; a QA sample is as long as its turns)")
    finetune_lr: float = Field(1e-4, gt=0, description="Adam's learning rate for fine-tuning")
    finetune_encoders: bool = Field(False, description=(
        "fine-tuning also moves the producer-side encoders of the hidden-state codes (the codes themselves "
        "learn what the consumer needs), not only the consumer-side decoders and aligners"))
    patch_cost: float = Field(0.1, ge=0, description="one Patch layer's consumer work relative to the whole Reuse rebuild")
    payload_budget: float = Field(0.15, ge=0, le=1, description=(
        "> 0: calibration chooses r_k and r_v (or r_x) by validation KL among the ranks whose codes stay within "
        "this fraction of the raw KV, the cheapest one the lowest-KL one does not beat beyond the validation "
        "samples' noise (0: the ranks as given)"))
    choose_level: bool = Field(True, description=(
        "after fitting, the served code is the artifact's nested level (PairArtifacts.levels) with the lowest "
        "validation KL, and the artifact is published at that level: a wider code that scores no lower costs "
        "bytes and the consumer's decode for nothing (false: the full ranks)"))
    reuse_source: Literal["kv", "hidden"] = Field("hidden", description=(
        "Reuse codes: 'kv' per-head codecs of the producer's K and V (r_k, r_v); 'hidden' one code per token "
        "from the producer's x_norm, decoded into the K and V of every head of the consumer (r_x)"))
    r_x: int = Field(64, ge=1, description="rank of the hidden-state Reuse codes")
    x_group: int = Field(6, ge=0, description=(
        "adjacent layers per hidden-state code (a shared cross-layer subspace: one code per token read from the "
        "x_norm of every layer of the group, decoded into each one's K and V); 1 = a code per layer, 0 = one "
        "code for all layers"))
    token_table: int = Field(0, ge=0, description=(
        "hidden-state codes: the decoders add a row per token for the calibration's this many most frequent "
        "tokens (0 = none). Free on the wire, the consumer has the token ids: the part of its K and V that is a "
        "function of the token alone, which no linear map of the producer's features expresses"))
    token_shrink: float = Field(1.0, gt=0, description=(
        "ridge of the token table, in rows: a token seen n times keeps n / (n + token_shrink) of its mean"))
    bigram_table: int = Field(0, ge=0, description=(
        "with token_table: the decoders also add a row per (previous token, token) pair for the calibration's "
        "this many most frequent pairs, on top of the token's row (0 = none; free on the wire too)"))
    bigram_shrink: float = Field(16.0, gt=0, description=(
        "ridge of the bigram table, in rows: a pair seen n times keeps n / (n + bigram_shrink) of what it adds "
        "to its token's row"))
    code_dtype: Literal[CODE_DTYPES] = Field("mixed", description=(
        "precision of the codes on the wire, what the payload budget counts and what validation scores; int8 "
        "(per-row scales) halves the bytes of a rank, so a payload budget buys twice the rank; int4 (per-row "
        "scales, two values a byte) four times; mixed: a code's first third (its widest columns) in int8, the "
        "rest in int4, three times"))
    batch: int = Field(8, ge=1, description="prefixes per tracing and fine-tuning batch")
    seed: int = Field(0, description="seed of the Patch aligners' initialisation and the fine-tuning's batch order")

    def for_hidden(self, hidden_size: int):
        """These settings for a model of that hidden size: Patch codes no wider than the hidden state they
        encode (r_h capped; a wider one carries no more)."""
        return self if self.r_h <= hidden_size else self.model_copy(update={"r_h": hidden_size})

    @classmethod
    def of(cls, settings: BaseModel) -> "CalibConfig":
        """The fit settings within a larger settings model (e.g. the config's calibration section)."""
        return cls(**settings.model_dump(include=set(cls.model_fields)))

    @model_validator(mode="after")
    def _bigrams_back_off_to_tokens(self):
        if self.bigram_table and not self.token_table:
            raise ValueError("bigram_table needs token_table > 0: a pair's row is added on top of its token's row")
        return self
