"""Tests for the banner of gateway/up.py: it suggests a request for a model the cluster serves."""

from __future__ import annotations

import json
import re

from tritonclient.grpc import model_config_pb2, service_pb2

from gateway.fleet.cluster import ModelInfo
from gateway.up import try_request

URL = "http://gateway.test:42017"  # only formatted into the banner, never connected to


def info(name: str, *inputs: tuple[str, str, list[int]]) -> ModelInfo:
    metadata = service_pb2.ModelMetadataResponse(name=name, versions=["1"])
    for tensor, datatype, shape in inputs:
        metadata.inputs.add(name=tensor, datatype=datatype, shape=shape)
    return ModelInfo(name, ("1",), model_config_pb2.ModelConfig(name=name), metadata, ())


def body(line: str) -> tuple[dict, str]:  # type: ignore[type-arg]
    match = re.fullmatch(r"  try: curl -s -d '(.*)' (\S+)", line)
    assert match, line
    return json.loads(match.group(1)), match.group(2)


def test_suggests_an_inference_request_for_a_served_model() -> None:
    models = {"encoder": info("encoder", ("TOKENS", "INT64", [-1, -1])),
              "tagger": info("tagger", ("TEXT", "BYTES", [-1, 1]), ("FLAG", "BOOL", [1]))}
    request, url = body(try_request(models, URL))
    assert url == f"{URL}/v2/models/encoder/infer"  # the first by name when no example model is served
    assert request == {"inputs": [{"name": "TOKENS", "shape": [1, 1], "datatype": "INT64", "data": [0]}]}
    request, url = body(try_request({"tagger": models["tagger"]}, URL))
    assert [i["data"] for i in request["inputs"]] == [["text"], [False]]


def test_prefers_the_example_model_and_falls_back_to_metadata_for_large_inputs() -> None:
    models = {"a": info("a", ("X", "FP32", [-1, 2])), "simple": info("simple", ("INPUT0", "INT32", [-1, 16]))}
    assert body(try_request(models, URL))[1] == f"{URL}/v2/models/simple/infer"
    assert try_request({"big": info("big", ("IMAGE", "FP32", [-1, 3, 224, 224]))}, URL) == \
        f"  try: curl -s {URL}/v2/models/big"


def test_with_no_model_served_suggests_the_repository_index() -> None:
    assert "v2/repository/index" in try_request({}, URL)


def test_skips_optional_inputs_and_prefers_a_model_that_answers_once() -> None:
    config = model_config_pb2.ModelConfig(name="lm")
    config.model_transaction_policy.decoupled = True
    config.input.add(name="text_input")
    config.input.add(name="max_tokens", optional=True)
    lm = info("lm", ("text_input", "BYTES", [1]), ("max_tokens", "INT32", [1]))
    lm = ModelInfo("lm", ("1",), config, lm.metadata, ())
    scorer = info("scorer", ("X", "FP32", [-1, 2]))
    assert body(try_request({"lm": lm, "scorer": scorer}, URL))[1] == f"{URL}/v2/models/scorer/infer"
    line = try_request({"lm": lm}, URL)
    match = re.fullmatch(r"  try: curl -sN -d '(.*)' (\S+)", line)
    assert match, line
    assert json.loads(match.group(1)) == {"text_input": "text"}
    assert match.group(2) == f"{URL}/v2/models/lm/generate_stream"
