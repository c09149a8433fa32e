"""corolla.checkpoint: selective loading from every HF checkpoint layout, the hub path and the LRU disk cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FakeHub
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from corolla.checkpoint import (
    CheckpointSource,
    checkpoint_files_for,
    load_config,
    load_tensors,
    reader,
    source,
)
from corolla.checkpoint.disk_cache import (
    CacheEntry,
    DiskCache,
    DiskSpaceError,
    choose_evictions,
)

FORMATS = ["single", "sharded", "bin", "binshard"]


def is_layer_1(name: str) -> bool:
    return name.startswith("model.layers.1.")


def make_tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    """The tiny Llama's state dict: what every checkpoint below holds."""
    return {name: tensor.detach().clone() for name, tensor in make_tiny_llama().state_dict().items()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, reference) -> dict[str, Path]:
    """The tiny Llama saved four ways; transformers 5 writes only safetensors, so .bin is torch.save'd."""
    root = tmp_path_factory.mktemp("checkpoints")
    model = make_tiny_llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")

    (root / "bin").mkdir()
    shutil.copy(root / "single" / "config.json", root / "bin")
    torch.save(reference, root / "bin" / "pytorch_model.bin")

    (root / "binshard").mkdir()
    shutil.copy(root / "single" / "config.json", root / "binshard")
    st_map = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    bin_map = {n: f.replace("model-", "pytorch_model-").replace(".safetensors", ".bin") for n, f in st_map.items()}
    for filename in sorted(set(bin_map.values())):
        torch.save({n: t for n, t in reference.items() if bin_map[n] == filename}, root / "binshard" / filename)
    index = {"metadata": {"total_size": 0}, "weight_map": bin_map}
    (root / "binshard" / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return {fmt: root / fmt for fmt in FORMATS}


def weight_map(directory: Path) -> dict[str, str]:
    index = next(directory.glob("*.index.json"))
    return json.loads(index.read_text())["weight_map"]


# ---------------------------------------------------------------- local directories


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_tensors_returns_exactly_the_wanted_block_equal_to_the_original(fmt, checkpoints, reference):
    loaded = load_tensors(str(checkpoints[fmt]), is_layer_1)

    expected = {name for name in reference if is_layer_1(name)}
    assert set(loaded) == expected and len(expected) == 9
    for name in expected:
        assert loaded[name].dtype == reference[name].dtype
        assert torch.equal(loaded[name], reference[name])


@pytest.mark.parametrize("fmt", ["sharded", "binshard"])
def test_sharded_checkpoint_opens_only_the_shards_holding_wanted_tensors(fmt, checkpoints, monkeypatch):
    directory = checkpoints[fmt]
    expected = sorted({f for name, f in weight_map(directory).items() if is_layer_1(name)})
    all_shards = set(weight_map(directory).values())
    assert 0 < len(expected) < len(all_shards)
    opened: list[str] = []
    real_safe_open, real_torch_load = reader.safe_open, torch.load
    monkeypatch.setattr(reader, "safe_open", lambda p, **kw: opened.append(Path(p).name) or real_safe_open(p, **kw))
    monkeypatch.setattr(reader.torch, "load", lambda p, **kw: opened.append(Path(p).name) or real_torch_load(p, **kw))

    assert checkpoint_files_for(str(directory), is_layer_1) == expected
    load_tensors(str(directory), is_layer_1)

    assert opened == expected


def test_checkpoint_files_for_single_file_answers_that_file(checkpoints):
    assert checkpoint_files_for(str(checkpoints["single"]), is_layer_1) == ["model.safetensors"]
    assert checkpoint_files_for(str(checkpoints["bin"]), is_layer_1) == ["pytorch_model.bin"]
    assert checkpoint_files_for(str(checkpoints["sharded"]), lambda name: False) == []


@pytest.mark.parametrize("fmt", FORMATS)
def test_dtype_casts_floating_tensors(fmt, checkpoints, reference):
    loaded = load_tensors(str(checkpoints[fmt]), is_layer_1, dtype=torch.bfloat16)

    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_dtype_leaves_integer_tensors_untouched(fmt, tmp_path):
    state = {"a.weight": torch.randn(3, 4), "a.index": torch.arange(5, dtype=torch.int64)}
    if fmt == "safetensors":
        save_file(state, tmp_path / "model.safetensors")
    else:
        torch.save(state, tmp_path / "pytorch_model.bin")

    loaded = load_tensors(str(tmp_path), lambda name: name.startswith("a."), dtype=torch.float16)

    assert loaded["a.weight"].dtype == torch.float16
    assert loaded["a.index"].dtype == torch.int64 and torch.equal(loaded["a.index"], state["a.index"])


def test_bin_tensors_do_not_share_memory_with_each_other(tmp_path):
    shared = torch.randn(4, 4)
    torch.save({"embed.weight": shared, "head.weight": shared}, tmp_path / "pytorch_model.bin")

    loaded = load_tensors(str(tmp_path), lambda name: True)

    loaded["embed.weight"].zero_()
    assert torch.equal(loaded["head.weight"], shared)


def test_legacy_bin_without_zip_format_still_loads(tmp_path):
    state = {"a.weight": torch.randn(2, 2)}
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)

    assert torch.equal(load_tensors(str(tmp_path), lambda name: True)["a.weight"], state["a.weight"])


def test_safetensors_is_preferred_when_both_formats_exist(tmp_path):
    save_file({"a.weight": torch.ones(2)}, tmp_path / "model.safetensors")
    torch.save({"a.weight": torch.zeros(2)}, tmp_path / "pytorch_model.bin")

    assert torch.equal(load_tensors(str(tmp_path), lambda name: True)["a.weight"], torch.ones(2))
    assert checkpoint_files_for(str(tmp_path), lambda name: True) == ["model.safetensors"]


def test_directory_without_weight_files_raises_file_not_found(checkpoints, tmp_path):
    shutil.copy(checkpoints["single"] / "config.json", tmp_path)

    with pytest.raises(FileNotFoundError, match="no weight files"):
        load_tensors(str(tmp_path), is_layer_1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_wanted_matching_nothing_raises_value_error(fmt, checkpoints):
    with pytest.raises(ValueError, match="matches `wanted`"):
        load_tensors(str(checkpoints[fmt]), lambda name: name.startswith("transformer.h."))


def test_index_naming_a_tensor_its_shard_lacks_raises_value_error(tmp_path):
    save_file({"a.weight": torch.ones(2)}, tmp_path / "model-1.safetensors")
    index = {"weight_map": {"a.weight": "model-1.safetensors", "b.weight": "model-1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))

    with pytest.raises(ValueError, match="lacks"):
        load_tensors(str(tmp_path), lambda name: True)


def test_model_that_is_neither_directory_nor_repo_id_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither an existing directory nor a valid hub repo id"):
        load_tensors(str(tmp_path / "missing"), is_layer_1)
    with pytest.raises(FileNotFoundError, match="neither"):
        load_config("./no/such/dir")


def test_load_config_reads_a_local_directory(checkpoints, tmp_path):
    config = load_config(str(checkpoints["sharded"]))
    assert config.model_type == "llama" and config.hidden_size == 32 and config.num_hidden_layers == 2

    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(str(tmp_path))


# ---------------------------------------------------------------- hub path, with a fake hub


class UnreachableHub:
    def list_files(self, *args, **kwargs):
        raise AssertionError("the hub must not be contacted")

    download = list_files


def test_hub_repo_downloads_only_needed_shards_and_reuses_the_cache(checkpoints, reference, tmp_path):
    hub = FakeHub(checkpoints["sharded"])
    needed = sorted({f for name, f in weight_map(checkpoints["sharded"]).items() if is_layer_1(name)})

    first = load_tensors("org/tiny", is_layer_1, cache_dir=str(tmp_path), hub=hub)
    assert hub.downloads == ["model.safetensors.index.json", *needed]

    second = load_tensors("org/tiny", is_layer_1, cache_dir=str(tmp_path), hub=hub)
    assert hub.downloads == ["model.safetensors.index.json", *needed]  # nothing new
    for name in first:
        assert torch.equal(first[name], reference[name]) and torch.equal(second[name], reference[name])


def test_hub_load_config_and_files_for(checkpoints, tmp_path):
    hub = FakeHub(checkpoints["sharded"])

    config = load_config("org/tiny", cache_dir=str(tmp_path), hub=hub)
    files = checkpoint_files_for("org/tiny", is_layer_1, cache_dir=str(tmp_path), hub=hub)

    assert config.hidden_size == 32
    assert files == sorted({f for name, f in weight_map(checkpoints["sharded"]).items() if is_layer_1(name)})
    assert hub.downloads == ["config.json", "model.safetensors.index.json"]  # no weights fetched


def test_hub_missing_file_raises_file_not_found(checkpoints, tmp_path):
    src = CheckpointSource("org/tiny", cache_dir=tmp_path, hub=FakeHub(checkpoints["sharded"]))
    with pytest.raises(FileNotFoundError, match="no file 'nope.json'"):
        src.fetch("nope.json")


def test_existing_local_directory_wins_over_a_repo_of_the_same_name(checkpoints, tmp_path, monkeypatch):
    shutil.copytree(checkpoints["single"], tmp_path / "org" / "tiny")
    monkeypatch.chdir(tmp_path)

    loaded = load_tensors("org/tiny", is_layer_1, hub=UnreachableHub())

    assert len(loaded) == 9
    assert load_config("org/tiny", hub=UnreachableHub()).hidden_size == 32


def shard_holding(directory: Path, shard_number: int) -> tuple[str, str]:
    """(shard file name, the first tensor name it holds) for shard `shard_number` (1-based)."""
    by_file: dict[str, list[str]] = {}
    for name, filename in weight_map(directory).items():
        by_file.setdefault(filename, []).append(name)
    filename = sorted(by_file)[shard_number - 1]
    return filename, sorted(by_file[filename])[0]


def only(name: str):
    return lambda candidate: candidate == name


def hub_size(hub: FakeHub, filename: str) -> int:
    return (hub.root / filename).stat().st_size


def test_max_disk_space_evicts_the_least_recently_used_shard(checkpoints, tmp_path):
    hub = FakeHub(checkpoints["sharded"])
    index = "model.safetensors.index.json"
    (x, x_name), (y, y_name), (z, z_name) = (shard_holding(hub.root, i) for i in (2, 3, 4))
    kwargs = dict(cache_dir=str(tmp_path), hub=hub)
    load_tensors("org/tiny", only(x_name), **kwargs)
    load_tensors("org/tiny", only(y_name), **kwargs)

    limit = hub_size(hub, index) + hub_size(hub, y) + hub_size(hub, z)  # room for Z only once X is gone
    load_tensors("org/tiny", only(z_name), max_disk_space=limit, **kwargs)

    cached = {entry.key.rsplit(":", 1)[1] for entry in DiskCache(tmp_path).entries()}
    assert cached == {index, y, z}
    assert hub.downloads == [index, x, y, z]
    load_tensors("org/tiny", only(y_name), **kwargs)
    assert hub.downloads == [index, x, y, z]  # Y survived
    load_tensors("org/tiny", only(x_name), **kwargs)
    assert hub.downloads == [index, x, y, z, x]  # X was evicted


def test_eviction_follows_last_use_not_first_download(checkpoints, tmp_path):
    hub = FakeHub(checkpoints["sharded"])
    index = "model.safetensors.index.json"
    (x, x_name), (y, y_name), (z, z_name) = (shard_holding(hub.root, i) for i in (2, 3, 4))
    kwargs = dict(cache_dir=str(tmp_path), hub=hub)
    for name in (x_name, y_name, x_name):  # X used again after Y
        load_tensors("org/tiny", only(name), **kwargs)

    limit = hub_size(hub, index) + hub_size(hub, x) + hub_size(hub, z)
    load_tensors("org/tiny", only(z_name), max_disk_space=limit, **kwargs)

    cached = {entry.key.rsplit(":", 1)[1] for entry in DiskCache(tmp_path).entries()}
    assert cached == {index, x, z}


def test_limit_too_small_for_the_load_raises_and_deletes_nothing(checkpoints, tmp_path):
    hub = FakeHub(checkpoints["sharded"])
    index = "model.safetensors.index.json"
    (x, x_name), (y, y_name), (z, z_name) = (shard_holding(hub.root, i) for i in (2, 3, 4))
    kwargs = dict(cache_dir=str(tmp_path), hub=hub)
    load_tensors("org/tiny", only(x_name), **kwargs)
    load_tensors("org/tiny", only(y_name), **kwargs)

    limit = hub_size(hub, index) + hub_size(hub, z) - 1
    with pytest.raises(DiskSpaceError, match="max_disk_space"):
        load_tensors("org/tiny", only(z_name), max_disk_space=limit, **kwargs)

    cached = {entry.key.rsplit(":", 1)[1] for entry in DiskCache(tmp_path).entries()}
    assert cached == {index, x, y}
    assert hub.downloads == [index, x, y]


def test_evicting_a_hub_cache_snapshot_link_deletes_its_blob_too(tmp_path):
    """hf_hub_download returns snapshots/<rev>/<file>, a symlink into blobs/; both must go."""
    blob = tmp_path / "models--org--tiny" / "blobs" / "abc123"
    link = tmp_path / "models--org--tiny" / "snapshots" / "rev" / "model.safetensors"
    blob.parent.mkdir(parents=True)
    link.parent.mkdir(parents=True)
    blob.write_bytes(b"x" * 100)
    link.symlink_to(blob)
    cache = DiskCache(tmp_path)
    cache.record_use("org/tiny@main:model.safetensors", link)
    assert cache.cached_path("org/tiny@main:model.safetensors") == link

    evicted = cache.make_room(needed_bytes=50, limit_bytes=100, protected=set())

    assert evicted == ["org/tiny@main:model.safetensors"]
    assert not blob.exists() and not link.is_symlink()
    assert cache.entries() == [] and cache.cached_path("org/tiny@main:model.safetensors") is None


def test_a_damaged_ledger_is_treated_as_empty(tmp_path):
    (tmp_path / "corolla-disk-cache.json").write_text("{not json")
    assert DiskCache(tmp_path).entries() == []


# ---------------------------------------------------------------- the real hub client, with hf calls substituted


def test_hub_client_passes_repo_revision_token_and_cache_dir_to_hf_hub_download(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(source, "hf_hub_download", lambda *a, **kw: calls.append((a, kw)) or str(tmp_path / "f"))

    path = source.HubClient().download("org/tiny", "config.json", revision="abc", token="t", cache_dir=tmp_path)

    assert path == tmp_path / "f"
    assert calls == [(("org/tiny", "config.json"), {"cache_dir": tmp_path, "revision": "abc", "token": "t"})]


def test_hub_client_lists_sizes_and_falls_back_to_a_cached_snapshot_offline(tmp_path, monkeypatch):
    class Sibling:
        def __init__(self, rfilename, size):
            self.rfilename, self.size = rfilename, size

    class OnlineApi:
        def model_info(self, repo_id, *, revision, token, files_metadata):
            assert files_metadata
            return type("Info", (), {"siblings": [Sibling("config.json", 10), Sibling("model.safetensors", None)]})()

    class OfflineApi:
        def model_info(self, *args, **kwargs):
            raise RuntimeError("no network")  # stands for httpx's errors, which are not OSError

    monkeypatch.setattr(source, "HfApi", OnlineApi)
    client = source.HubClient()
    kw = dict(revision=None, token=None, cache_dir=tmp_path)
    assert client.list_files("org/tiny", **kw) == {"config.json": 10, "model.safetensors": None}

    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(source, "HfApi", OfflineApi)
    monkeypatch.setattr(source, "snapshot_download", lambda *a, **k: str(snapshot))
    assert client.list_files("org/tiny", **kw) == {"config.json": 2}

    def not_cached(*args, **kwargs):
        raise FileNotFoundError("not cached")

    monkeypatch.setattr(source, "snapshot_download", not_cached)
    with pytest.raises(ConnectionError, match="no network"):
        client.list_files("org/tiny", **kw)
    with pytest.raises(FileNotFoundError, match="listing it on the hub failed"):
        CheckpointSource("org/tiny", cache_dir=tmp_path).files()


def test_default_cache_dir_honors_corolla_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("COROLLA_CACHE", str(tmp_path))
    assert source.default_cache_dir() == tmp_path
    monkeypatch.delenv("COROLLA_CACHE")
    assert source.default_cache_dir() == Path.home() / ".cache" / "corolla"


# ---------------------------------------------------------------- choose_evictions (pure)


def entry(key: str, size: int, last_access: float) -> CacheEntry:
    return CacheEntry(key=key, size=size, last_access=last_access)


ENTRIES = [entry("c", 100, 3.0), entry("a", 100, 1.0), entry("b", 100, 2.0)]


def test_choose_evictions_returns_nothing_when_the_file_fits():
    assert choose_evictions(ENTRIES, needed_bytes=100, limit_bytes=400, protected=set()) == []
    assert choose_evictions([], needed_bytes=0, limit_bytes=0, protected=set()) == []


def test_choose_evictions_takes_least_recently_used_first_until_it_fits():
    assert choose_evictions(ENTRIES, needed_bytes=101, limit_bytes=400, protected=set()) == ["a"]
    assert choose_evictions(ENTRIES, needed_bytes=150, limit_bytes=300, protected=set()) == ["a", "b"]
    assert choose_evictions(ENTRIES, needed_bytes=300, limit_bytes=300, protected=set()) == ["a", "b", "c"]


def test_choose_evictions_never_takes_protected_files():
    assert choose_evictions(ENTRIES, needed_bytes=150, limit_bytes=300, protected={"a"}) == ["b", "c"]


def test_choose_evictions_breaks_ties_by_key():
    tied = [entry("z", 10, 5.0), entry("m", 10, 5.0), entry("q", 10, 1.0)]
    assert choose_evictions(tied, needed_bytes=15, limit_bytes=30, protected=set()) == ["q", "m"]


def test_choose_evictions_counts_sizes_not_files():
    mixed = [entry("old-small", 10, 1.0), entry("mid-big", 500, 2.0), entry("new-small", 10, 3.0)]
    assert choose_evictions(mixed, needed_bytes=100, limit_bytes=600, protected=set()) == ["old-small", "mid-big"]


def test_choose_evictions_raises_when_protected_files_leave_no_room():
    with pytest.raises(DiskSpaceError, match="max_disk_space=250"):
        choose_evictions(ENTRIES, needed_bytes=100, limit_bytes=250, protected={"a", "b"})
    with pytest.raises(DiskSpaceError):
        choose_evictions([], needed_bytes=101, limit_bytes=100, protected=set())
