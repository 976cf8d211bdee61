"""openapi/openapi.yaml is a valid OpenAPI 3.0 document (openapi-spec-validator, from PyPI:
generated clients and API gateways read it), the check fails on the kind of slip that once
got through (an unquoted comma in a YAML flow mapping adding a stray key to a schema), and
every `default` the document states for a request field is what the server does when the
field is left out (the same answer with and without it, on the real daemon)."""
import copy
import json

import pytest
import yaml

from conftest import ROOT
from test_http import Daemon, docs, fitmd_bin, models, post  # noqa: F401

SPEC_PATH = ROOT / "openapi" / "openapi.yaml"


def load_spec():
    return yaml.safe_load(SPEC_PATH.read_text())


def validate(spec):
    mod = pytest.importorskip("openapi_spec_validator")
    mod.validate(spec)


def test_spec_is_valid_openapi():
    validate(load_spec())


def test_a_stray_key_fails_validation():
    spec = load_spec()
    validate(spec)
    # The slip itself: a description with an unquoted comma inside a flow mapping.
    slip = yaml.safe_load("{type: boolean, nullable: true, description: With documents, as "
                          "/answer's.}")
    assert "as /answer's." in slip  # YAML read the text after the comma as a key
    bad = copy.deepcopy(spec)
    bad["components"]["schemas"]["OpenAIOptions"]["properties"]["calibrate"] = slip
    with pytest.raises(Exception) as e:
        validate(bad)
    assert "as /answer's." in str(e.value)
    # and anywhere else a key is unknown: an operation, a response
    for where in (lambda s: s["paths"]["/rerank"]["post"],
                  lambda s: s["components"]["responses"]["BadRequest"]):
        bad = copy.deepcopy(spec)
        where(bad)["stray"] = 1
        with pytest.raises(Exception):
            validate(bad)


def properties(spec, schema):
    """The top-level properties of a request schema, through $ref and allOf."""
    if "$ref" in schema:
        return properties(spec, spec["components"]["schemas"][schema["$ref"].split("/")[-1]])
    out = {}
    for part in schema.get("allOf", []):
        out.update(properties(spec, part))
    out.update(schema.get("properties", {}))
    return out


def comparable(x):
    """A response without what differs between two identical requests (ids, times)."""
    if isinstance(x, dict):
        return {k: comparable(v) for k, v in x.items()
                if k not in ("id", "created") and not k.endswith("_ms")}
    if isinstance(x, list):
        return [comparable(v) for v in x]
    return x


BASES = {
    "/rerank": {"query": "alpha bravo", "documents": docs(3, 5)},
    "/v1/score": {"text_1": "alpha bravo", "text_2": docs(3, 5)},
    "/tokenize": {"content": "alpha bravo"},
    "/detokenize": {"tokens": [3, 4, 5]},
    "/answer": {"query": "alpha bravo", "documents": docs(3, 5), "max_tokens": 6, "seed": 7},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "alpha"}],
                             "max_tokens": 6, "seed": 7},
    "/v1/completions": {"prompt": "alpha", "max_tokens": 6, "seed": 7},
}


def test_documented_defaults_are_the_servers(fitmd_bin, models, tmp_path):  # noqa: F811
    spec = load_spec()
    d = Daemon(fitmd_bin, models["small"], tmp_path, max_documents=16)
    checked = []
    try:
        for path, item in spec["paths"].items():
            op = item.get("post")
            if not op or "requestBody" not in op:
                continue
            alias = next((p for p in BASES if path.endswith(p) or p.endswith(path)), None)
            assert alias, f"no base request for {path}: add one to BASES"
            base = BASES[alias]
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            without = post(d, base, path=path)
            assert without.status_code == 200, (path, without.text)
            for name, prop in properties(spec, schema).items():
                if "default" not in prop or name in base:
                    continue
                r = post(d, {**base, name: prop["default"]}, path=path)
                assert r.status_code == 200, (path, name, r.text)
                assert comparable(r.json()) == comparable(without.json()), \
                    f"{path}: {name} = {json.dumps(prop['default'])} is not the default"
                checked.append((path, name))
    finally:
        assert d.terminate() == 0
    # the defaults every route family documents were all exercised
    names = {n for _, n in checked}
    # (`method` has none: the server's is the model's profile's, docs/scoring.md)
    assert {"return_documents", "prefix_reuse", "temperature", "top_p", "stream",
            "ignore_eos", "add_special"} <= names, names
