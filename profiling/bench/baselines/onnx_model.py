"""The ONNX Runtime baseline's model: an ONNX export of the bundled model (optimum from Infinity's virtualenv
where there is one, else torch.onnx.export) with its tokenizer, mean pooling and normalization."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class Export:
    path: Path  # directory holding model.onnx and the tokenizer files
    exporter: str  # how it was made, for the report


def export(model_dir: Path, out_dir: Path, *, optimum_cli: str | None = None, timeout_s: float = 900) -> Export:
    """Export ``model_dir`` (a local transformers model) to ``out_dir``/model.onnx."""
    out_dir.mkdir(parents=True, exist_ok=True)
    if optimum_cli:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run([optimum_cli, "export", "onnx", "--model", str(model_dir), "--task", "feature-extraction",
                               "--library-name", "transformers", str(out_dir)],
                              env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not (out_dir / "model.onnx").is_file():
            raise RuntimeError(f"optimum export failed ({done.returncode}): {done.stderr[-2000:]}")
        return Export(out_dir, f"optimum-onnx (`optimum-cli export onnx --task feature-extraction`, {optimum_cli})")
    _torch_export(model_dir, out_dir)
    return Export(out_dir, "torch.onnx.export (TorchScript exporter, opset 17; no optimum found: it needs "
                           "transformers < 4.58, see `make .venv-infinity/bin/infinity_emb`)")


def _torch_export(model_dir: Path, out_dir: Path) -> None:
    import shutil

    import torch
    from transformers import AutoModel

    class LastHiddenState(torch.nn.Module):
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    example = (ids, torch.ones_like(ids), torch.zeros_like(ids))
    axes = {name: {0: "batch_size", 1: "sequence_length"} for name in (*INPUT_NAMES, "last_hidden_state")}
    with torch.no_grad():
        torch.onnx.export(LastHiddenState(model), example, str(out_dir / "model.onnx"), input_names=list(INPUT_NAMES),
                          output_names=["last_hidden_state"], dynamic_axes=axes, opset_version=17, dynamo=False)
    for f in model_dir.iterdir():  # the tokenizer and config, as optimum's export directory has them
        if f.is_file() and f.suffix in (".json", ".txt") and f.name != "modules.json":
            shutil.copy(f, out_dir / f.name)


def for_infinity(export_dir: Path, out_dir: Path, max_seq_length: int) -> Path:
    """A copy (model.onnx hard-linked) whose config's max_position_embeddings is ``max_seq_length``: Infinity
    truncates inputs there, so longer inputs give the model's own vectors."""
    import json
    import shutil

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in export_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            try:
                os.link(f, out_dir / f.name)
            except OSError:
                shutil.copy(f, out_dir / f.name)
    config = json.loads((export_dir / "config.json").read_text())
    config["max_position_embeddings"] = min(int(config.get("max_position_embeddings", max_seq_length)), max_seq_length)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


class OnnxSentenceEncoder:
    """ONNX Runtime behind the SentenceTransformer methods the servers call (``encode``: mean pooling, unit length)."""

    def __init__(self, export_dir: Path, *, threads: int = 0, max_seq_length: int = 256) -> None:
        import onnxruntime as ort
        from transformers import AutoTokenizer

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL  # BERT fusions
        options.intra_op_num_threads = threads  # 0: ONNX Runtime's own choice
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(Path(export_dir) / "model.onnx"), options,
                                            providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self.session.get_inputs()}
        self.tokenizer = AutoTokenizer.from_pretrained(str(export_dir))
        self.max_seq_length = max_seq_length
        self._dim = int(self.session.get_outputs()[0].shape[-1])

    def get_embedding_dimension(self) -> int:
        return self._dim

    def encode(self, texts: list[str], batch_size: int = 32, normalize_embeddings: bool = True,
               convert_to_numpy: bool = True, show_progress_bar: bool = False) -> np.ndarray:
        out = []
        for first in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[first:first + batch_size], padding=True, truncation=True,
                                 max_length=self.max_seq_length, return_tensors="np")
            feed = {k: v.astype(np.int64) for k, v in enc.items() if k in self._inputs}
            hidden = self.session.run(["last_hidden_state"], feed)[0]
            mask = enc["attention_mask"][..., None].astype(np.float32)
            pooled = (hidden * mask).sum(1) / np.clip(mask.sum(1), 1e-9, None)
            if normalize_embeddings:
                pooled /= np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
            out.append(pooled.astype(np.float32))
        return np.concatenate(out)
