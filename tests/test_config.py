import pytest

from gateway.config import ConfigError, hash_key, load_config, parse_config


def base():
    return {
        "models": [{"name": "glm", "pools": ["p"]}],
        "pools": [{"name": "p", "kind": "sglang", "model": "m", "replicas": [{"name": "r0", "url": "http://127.0.0.1:1"}]}],
        "tenants": [{"name": "t", "api_key_hashes": [hash_key("k")], "models": ["glm"]}],
    }


def test_valid_config_loads_with_defaults():
    cfg = parse_config(base())
    assert cfg.timeouts.first_byte == 120.0 and cfg.retry.max_attempts == 3


@pytest.mark.parametrize(
    "mutate,expected",
    [
        (lambda c: c["pools"][0]["replicas"][0].update(url="ftp://x"), "pools[0].replicas[0].url"),
        (lambda c: c["pools"][0].update(kind="tgi"), "pools[0]"),
        (lambda c: c["pools"][0].update(colour="red"), "pools[0].colour: Extra inputs are not permitted"),
        (lambda c: c["models"][0].update(pools=["nope"]), "models[0].pools[0]: unknown pool 'nope'"),
        (lambda c: c["tenants"][0].update(models=["x"]), "tenants[0].models[0]: unknown model 'x'"),
        (lambda c: c["tenants"][0].update(api_key_hashes=["sk-raw-key"]), "tenants[0].api_key_hashes"),
        (lambda c: c["pools"][0].update(pricing={"type": "per_token", "input_per_mtok": -1, "output_per_mtok": 1}),
         "pools[0].pricing.input_per_mtok"),
        (lambda c: c.update(timeouts={"idle": 0}), "timeouts.idle"),
        (lambda c: c["pools"].append(dict(c["pools"][0])), "duplicate names ['p']"),
    ],
)
def test_errors_name_the_field(mutate, expected):
    cfg = base()
    mutate(cfg)
    with pytest.raises(ConfigError) as e:
        parse_config(cfg, "gw.yaml")
    assert expected in str(e.value) and str(e.value).startswith("gw.yaml: ")


def test_load_config_reports_file_problems(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)


def test_example_config_in_repo_is_valid():
    cfg = load_config("deploy/gateway.example.yaml")
    assert {p.kind for p in cfg.pools} == {"sglang", "openai"}
