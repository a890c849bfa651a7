"""HTTP bodies (OpenAI-compatible where OpenAI defines them) and the scd extension object."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")          # unknown OpenAI fields (n, logprobs, user...) are ignored

    model: str = Field(description="specialist name")
    prompt: str = Field(min_length=1, description="text to complete")
    prefix: str | None = Field(None, description="scd extension: a shared prefix the producer prefills; "
                                                 "the prompt is then the suffix the specialist reads after it")
    oracle: bool = Field(False, description="scd extension: the specialist prefills the prefix itself (the "
                                            "reference path), e.g. to compare time to first token")
    max_tokens: int = Field(16, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool = False
    seed: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list):
            if len(v) != 1 or not isinstance(v[0], str):
                raise ValueError("exactly one prompt string is supported (send several requests, or /v1/fanout)")
            return v[0]
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops


class FanoutItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    specialist: str
    suffix: str = Field(min_length=1)
    max_tokens: int = Field(16, ge=1, le=1024)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: list[str] = Field(default_factory=list, max_length=4)


class FanoutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefix: str = Field(min_length=1, description="the shared prefix: prefilled once by the producer")
    requests: list[FanoutItem] = Field(min_length=1, max_length=32)
