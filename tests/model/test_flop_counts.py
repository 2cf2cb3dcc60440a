"""tokq.model.flops: the one FLOP formula agrees with torch's own counter and with the layers the
engine runs; the device peak table; and counting FLOPs needs no Prometheus."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokq.model import flops
from tokq.batch import PackedBatch
from tokq.model.info import ModelInfo


def test_minilm_counts_its_linear_layers_and_each_sequences_square_of_attention():
    hidden, inter, layers = 384, 1536, 6
    linear = 2 * layers * (4 * hidden * hidden + 2 * hidden * inter)
    config = ModelInfo.load().config
    assert flops.linear_flops_per_token(config) == linear
    assert flops.forward_flops(config, [3, 5]) == 8 * linear + 4 * layers * hidden * (9 + 25)
    # a cached prompt of 2 tokens in the 5-token sequence: 3 computed tokens attend to all 5 keys
    assert flops.forward_flops(config, [3, 5], [0, 2]) == 6 * linear + 4 * layers * hidden * (9 + 15)


def test_engine_counts_with_the_formula():
    from tokq.workers.engine import Engine

    engine = Engine.load(None, device="cpu", dtype="float32")
    assert 2 * engine.model.num_linear_params == flops.linear_flops_per_token(engine.info.config)
    batch = PackedBatch.pack([[1] * 3, [1] * 5])
    assert engine.batch_flops(batch) == flops.forward_flops(engine.info.config, [3, 5])


@pytest.mark.slow
def test_the_engine_counts_flops_without_prometheus():
    code = "import sys, tokq.workers.engine; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_device_peak_flops_from_table_and_env():
    assert flops.peak_flops_for_name("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops_for_name("NVIDIA H100 PCIe") == 756e12
    assert flops.peak_flops_for_name("NVIDIA H200") == 989e12
    assert flops.peak_flops_for_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_flops_for_name("NVIDIA L4") == 121e12
    assert flops.peak_flops_for_name("NVIDIA L40S") == 362e12
    assert flops.peak_flops_for_name("Tesla K80") is None
    assert flops.device_peak_flops("cpu", env={}) is None
    assert flops.device_peak_flops("cpu", env={"TOKQ_DEVICE_PEAK_FLOPS": "2.5e12"}) == 2.5e12


def _torch_forward_flops(model, seqlen: int) -> int:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, 100, (1, seqlen))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(input_ids=ids)
    return counter.get_total_flops()


@pytest.mark.parametrize("family", ["bert", "qwen3"])
def test_forward_flops_matches_torch_flop_counter(family):
    """Our closed-form count against torch's FlopCounterMode on a tiny random model (eager
    attention: the counter sees its bmm calls, not the fused CPU SDPA kernel)."""
    import torch
    import transformers

    torch.manual_seed(0)
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, intermediate_size=128,
                                      attn_implementation="eager")
        model = transformers.BertModel(cfg, add_pooling_layer=False)
    else:
        cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       intermediate_size=96, attn_implementation="eager")
        model = transformers.Qwen3Model(cfg)
    model.eval()
    config = cfg.to_dict()
    for seqlen in (7, 33):
        assert flops.forward_flops(config, [seqlen]) == _torch_forward_flops(model, seqlen)
    # a packed batch costs its sequences' sum: attention is per sequence, not over the pack
    assert flops.forward_flops(config, [7, 33]) == (
        flops.forward_flops(config, [7]) + flops.forward_flops(config, [33]))


@pytest.mark.cuda
def test_device_peak_flops_names_the_local_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    name = torch.cuda.get_device_name(0)
    assert flops.device_peak_flops("cuda:0", env={}) == flops.peak_flops_for_name(name)
