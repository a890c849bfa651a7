"""Serving engines: plain Python that holds models and computes, tested without Ray.

- producer.py: ProducerEngine, one prefill of a prefix and the codes of it for every pair asked.
- specialist.py: SpecialistEngine, a specialist's prefix rebuilt from codes (or prefilled, stated), its suffix,
  exact mode's draft and verify.
- group.py: GroupEngine, a LoRA group: one base and its adapters, the prefix's base layers once for all.
- batching.py: the decode loop every engine runs on a thread of its own; prefix_cache.py: their LRU caches.
- interface.py: what an answering engine is to the Ray actor that holds it (answer, status, stop) and the one
  EngineConfig it is built from.

The Ray actors in actors/ hold one engine each, built in their own process from an EngineConfig, and add what
needs Ray: artifacts through the registry, codes through a transport, the adapter book, drills.
"""
