"""The embedding backend on a hand-built encoder export: a WordPiece
``tokenizer.json`` (a stored truncation of 4 tokens, which must not apply),
a ``config.json`` naming ``BertModel``, and a ``model.onnx`` whose token
states are rows of a table (``Gather``), so every embedding is known in
numpy. Checked: which directories are encoder exports, what the files set
(the limit is the least of the three files'), sentence-transformers'
pooling modes and normalisation, padding that never leaks into another
row, token ids equal to their text, too long and out-of-vocabulary inputs
refused in the model's terms, cutting on request, and an export that pools
itself (``sentence_embedding``) taken as it is.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from tritonclient.grpc import model_config_pb2 as mc

from execution.backends.base import BackendOptions, Placement
from execution.backends.embed import EmbedBackend
from execution.backends.hf_encoder import Pooling, is_encoder_export, pool, read_encoder
from protos.errors import InvalidArgument

WORDS = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "."]
VOCAB = len(WORDS)
WIDTH = 3
TABLE = np.random.default_rng(0).normal(size=(VOCAB, WIDTH)).astype(np.float32)


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                             special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    tokenizer.enable_truncation(4)  # a training run's setting, saved with it: serving must ignore it
    tokenizer.save(str(path))


def _graph(path: Path, *, pooled: bool = False) -> None:
    """Token states = TABLE[input_ids]; pooled: their plain mean as ``sentence_embedding`` (one row, no padding)."""
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "tokens"])
              for n in ("input_ids", "attention_mask", "token_type_ids")]
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["last_hidden_state"])]
    outputs = [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, ["batch", "tokens", WIDTH])]
    if pooled:
        nodes.append(helper.make_node("ReduceMean", ["last_hidden_state"], ["sentence_embedding"], axes=[1],
                                      keepdims=0))
        outputs = [helper.make_tensor_value_info("sentence_embedding", TensorProto.FLOAT, ["batch", WIDTH])]
    graph = helper.make_graph(nodes, "encoder", inputs, outputs,
                              [helper.make_tensor("table", TensorProto.FLOAT, TABLE.shape, TABLE.ravel().tolist())])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), str(path))


def _export(directory: Path, *, sentence: bool = True, normalize: bool = True, pooling: str = "mean_tokens",
            pooled: bool = False, architecture: str = "BertModel") -> Path:  # fmt: skip
    directory.mkdir(parents=True)
    _tokenizer(directory / "tokenizer.json")
    _graph(directory / "model.onnx", pooled=pooled)
    (directory / "config.json").write_text(json.dumps({
        "architectures": [architecture], "hidden_size": WIDTH, "vocab_size": VOCAB, "max_position_embeddings": 16}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 12}))
    if sentence:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        (directory / "modules.json").write_text(json.dumps(modules))
        (directory / "1_Pooling").mkdir()
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(
            {"word_embedding_dimension": WIDTH, **{f"pooling_mode_{p.value}": p.value == pooling for p in Pooling}}))
        (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 8, "do_lower_case": False}))
    return directory


def _embed(version_dir: Path, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    backend = EmbedBackend(BackendOptions(intra_op_threads=1, execution_threads=1))
    try:
        config = backend.complete_config(mc.ModelConfig(name="enc"), version_dir)
        instance = backend.load(version_dir.parent, version_dir, config, Placement("cpu"))
        return asyncio.run(instance.infer(inputs, ["embedding", "prompt_tokens"]))
    finally:
        backend.close()


def _texts(*texts: str) -> dict[str, np.ndarray]:
    return {"text_input": np.array([[t.encode()] for t in texts], dtype=np.object_)}


def _expected(ids: list[int], *, normalized: bool = True) -> np.ndarray:
    vector = TABLE[ids].mean(axis=0)
    return vector / np.linalg.norm(vector) if normalized else vector


def test_an_encoder_export_is_told_from_a_decoders_and_from_other_models(tmp_path: Path) -> None:
    assert is_encoder_export(_export(tmp_path / "bert", sentence=False))
    assert is_encoder_export(_export(tmp_path / "st", architecture="BertForMaskedLM"))  # modules.json says so
    assert not is_encoder_export(_export(tmp_path / "classifier", sentence=False,
                                         architecture="BertForSequenceClassification"))
    assert not is_encoder_export(_export(tmp_path / "llama", sentence=False, architecture="LlamaForCausalLM"))
    (tmp_path / "bert" / "tokenizer.json").unlink()
    assert not is_encoder_export(tmp_path / "bert")


def test_the_files_set_width_vocabulary_limit_and_pooling(tmp_path: Path) -> None:
    settings = read_encoder(_export(tmp_path / "st"), "enc")
    assert (settings.width, settings.vocab_size, settings.pooling, settings.normalize) == (WIDTH, VOCAB, Pooling.MEAN,
                                                                                          True)
    assert (settings.max_tokens, settings.max_tokens_from) == (8, "max_seq_length in sentence_bert_config.json")
    plain = read_encoder(_export(tmp_path / "plain", sentence=False), "enc")
    assert (plain.max_tokens, plain.max_tokens_from) == (12, "model_max_length in tokenizer_config.json")
    assert (plain.pooling, plain.normalize, plain.sentence_transformers) == (Pooling.MEAN, False, False)
    assert read_encoder(_export(tmp_path / "cls", pooling="cls_token", normalize=False), "enc").pooling is Pooling.CLS
    weighted = _export(tmp_path / "weighted")
    (weighted / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_weightedmean_tokens": True}))
    with pytest.raises(InvalidArgument, match="pooling"):
        read_encoder(weighted, "enc")


def test_pooling_modes_read_only_the_rows_own_tokens() -> None:
    states = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    np.testing.assert_allclose(pool(states, mask, Pooling.MEAN), [states[0].mean(0), states[1, :2].mean(0)])
    np.testing.assert_allclose(pool(states, mask, Pooling.MEAN_SQRT_LEN),
                               [states[0].sum(0) / 2, states[1, :2].sum(0) / np.sqrt(2)], rtol=1e-6)
    np.testing.assert_allclose(pool(states, mask, Pooling.MAX), [states[0, 3], states[1, 1]])
    np.testing.assert_allclose(pool(states, mask, Pooling.LAST), [states[0, 3], states[1, 1]])
    np.testing.assert_allclose(pool(states, mask, Pooling.CLS), [states[0, 0], states[1, 0]])


def test_texts_of_different_lengths_embed_as_each_alone_and_as_their_token_ids(tmp_path: Path) -> None:
    export = _export(tmp_path / "st")
    texts = ["the cat sat on the mat", "a dog", "Dogs ran"]
    ids = [[1, 4, 5, 6, 7, 4, 8, 2], [1, 9, 10, 2], [1, 10, 12, 11, 2]]  # 8 tokens: past the stored truncation
    out = _embed(export, _texts(*texts))
    assert out["prompt_tokens"].ravel().tolist() == [len(i) for i in ids]
    np.testing.assert_allclose(out["embedding"], [_expected(i) for i in ids], rtol=1e-5, atol=1e-6)
    padded = np.zeros((3, 8), np.int64)
    mask = np.zeros((3, 8), np.int64)
    for row, values in enumerate(ids):
        padded[row, :len(values)], mask[row, :len(values)] = values, 1
    by_ids = _embed(export, {"input_ids": padded, "attention_mask": mask})
    np.testing.assert_allclose(by_ids["embedding"], out["embedding"], rtol=1e-6)
    plain = _embed(_export(tmp_path / "plain", sentence=False), _texts("a dog"))
    np.testing.assert_allclose(plain["embedding"][0], _expected([1, 9, 10, 2], normalized=False), rtol=1e-6)


def test_long_inputs_and_unknown_ids_are_refused_before_the_model_runs(tmp_path: Path) -> None:
    export = _export(tmp_path / "st")
    long = "the cat sat on the mat the cat"  # 10 tokens with [CLS] and [SEP]
    with pytest.raises(InvalidArgument, match=r"input 1 has 10 tokens; model 'enc' embeds at most 8 "
                                              r"\(max_seq_length in sentence_bert_config.json\)"):
        _embed(export, _texts("a dog", long))
    with pytest.raises(InvalidArgument, match=rf"token id {VOCAB} is not in the vocabulary of model 'enc' "
                                              rf"\({VOCAB} tokens: ids 0 to {VOCAB - 1}\)"):
        _embed(export, {"input_ids": np.array([[1, VOCAB, 2]], np.int64)})
    with pytest.raises(InvalidArgument, match="not UTF-8"):
        _embed(export, {"text_input": np.array([[b"\xff"]], dtype=np.object_)})
    cut = _embed(export, {**_texts("a dog", long), "truncate_prompt_tokens": np.array([[-1], [-1]], np.int32)})
    assert cut["prompt_tokens"].ravel().tolist() == [4, 8]
    np.testing.assert_allclose(cut["embedding"][1], _expected([1, 4, 5, 6, 7, 4, 8, 2]), rtol=1e-5)  # [SEP] kept
    short = _embed(export, {**_texts(long), "truncate_prompt_tokens": np.array([[3]], np.int32)})
    np.testing.assert_allclose(short["embedding"][0], _expected([1, 4, 2]), rtol=1e-5)
    with pytest.raises(InvalidArgument, match="more than model 'enc' embeds"):
        _embed(export, {**_texts(long), "truncate_prompt_tokens": np.array([[9]], np.int32)})


def test_an_export_that_pools_itself_is_taken_as_it_is(tmp_path: Path) -> None:
    out = _embed(_export(tmp_path / "pooled", pooled=True), _texts("a dog"))
    np.testing.assert_allclose(out["embedding"][0], TABLE[[1, 9, 10, 2]].mean(axis=0), rtol=1e-6)  # not normalised


def test_the_config_is_completed_from_the_files(tmp_path: Path) -> None:
    backend = EmbedBackend(BackendOptions(intra_op_threads=1, execution_threads=1))
    try:
        config = backend.complete_config(mc.ModelConfig(name="enc"), _export(tmp_path / "st"))
    finally:
        backend.close()
    assert config.backend == "embed" and config.max_batch_size == 2048
    assert [(i.name, i.optional) for i in config.input] == [
        ("text_input", True), ("input_ids", True), ("attention_mask", True), ("truncate_prompt_tokens", True)]
    assert [(o.name, list(o.dims)) for o in config.output] == [("embedding", [WIDTH]), ("prompt_tokens", [1])]
    assert {k: v.string_value for k, v in config.parameters.items()} == {
        "hf_export": "true", "max_tokens": "8", "vocab_size": str(VOCAB), "pooling": "mean", "normalize": "true"}
