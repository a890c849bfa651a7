"""What the probes share: a config's producer and one of its specialists, loaded."""
from __future__ import annotations

import torch

from cluster.config import load_config
from scd.online.models import load


def config_pair(config: str, pair: str):
    """(config, specialist name, producer, consumer, tokenizer, spec) of `pair` ("producer:specialist", or the
    specialist's name) in `config`; an unknown specialist is refused in one line. Seeds torch with the
    config's calibration seed."""
    cfg = load_config(config)
    name = pair.split(":", 1)[-1]
    try:
        s = cfg.specialist(name)
    except KeyError as e:
        raise SystemExit(str(e.args[0])) from None
    torch.manual_seed(cfg.calibration.seed)
    producer, tok, spec = load(cfg.producer.path)
    consumer, _, _ = load(s.path, base=s.base)
    return cfg, name, producer, consumer, tok, spec
