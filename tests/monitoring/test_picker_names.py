"""What the gateway's endpoint picker reads from an engine by default (its flags' defaults in v1.0.0), as the engine
exports it, without a model: KV usage under vllm:gpu_cache_usage_perc and one empty LoRA info series. The picker
itself reads them from real engines in tests/k8s/test_epp.py."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from slofleet.engine.server.metrics import PickerCollector


@dataclass
class Stats:
    kv_usage: float


@dataclass
class StubEngine:
    model_name: str
    kv_usage: float

    def stats(self) -> Stats:
        return Stats(self.kv_usage)


def scrape(engine: StubEngine) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(PickerCollector(engine))
    return {f.name: f.samples for f in text_string_to_metric_families(generate_latest(registry).decode())}


def test_kv_usage_under_the_pickers_default_name_follows_the_engine():
    engine = StubEngine("m", 0.0)
    assert [s.value for s in scrape(engine)["vllm:gpu_cache_usage_perc"]] == [0.0]
    engine.kv_usage = 0.375
    (sample,) = scrape(engine)["vllm:gpu_cache_usage_perc"]
    assert sample.value == 0.375 and sample.labels == {"model_name": "m"}


def test_lora_info_is_one_empty_series_in_vllms_label_format():
    (sample,) = scrape(StubEngine("m", 0.0))["vllm:lora_requests_info"]
    assert sample.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "", "max_lora": "0"}
    assert sample.value > 1e9  # vLLM's convention: the series' value is when it was read (unix seconds)
