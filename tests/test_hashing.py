from __future__ import annotations

import pytest
from conftest import load_vectors

from selection_proto import block_hashes, iv, sequence_hashes
from selection_proto.core.base.hashing import hash64, multimodal_block_hash


def test_every_reference_vector_matches_dynamo() -> None:
    cases = load_vectors("hashing.jsonl")
    assert len(cases) == 300
    for case in cases:
        blocks = block_hashes(case["token_ids"], case["block_size"], case.get("lora_name"),
                              case.get("cache_namespace"), case.get("is_eagle", False))
        assert blocks == case["block_hashes"], case
        if "sequence_hashes" in case:
            assert sequence_hashes(blocks) == case["sequence_hashes"], case


@pytest.mark.parametrize(
    ("tokens", "bs", "kwargs", "expected"),
    [
        ([1, 2, 3, 4], 4, {}, [14643705804678351452]),
        (list(range(1, 11)), 4, {}, [14643705804678351452, 16777012769546811212]),
        ([0, 1, 2, 3], 4, {}, [9143094415614847814]),
        ([0, 1, 2, 3], 4, {"lora_name": "adapter-a"}, [6665157333201000639]),
        ([0, 1, 2, 3], 4, {"cache_namespace": "tenant-a"}, [17009624042690211646]),
        ([0, 1, 2, 3], 4, {"lora_name": "adapter-a", "cache_namespace": "tenant-a"}, [8269515957840517240]),
        ([1, 2, 3, 4], 4, {"lora_name": "sql-lora"}, [19676506188544538]),
        (list(range(6)), 2, {"is_eagle": True}, [11646242937812223497, 9948816348502404300]),
        (list(range(6)), 2, {}, [10918435022357402928, 10731123482949079648, 12189426826560619506]),
        (list(range(32)), 16, {}, [15310707395893867146, 15292316782987903195]),
        ([1, 2, 3], 0, {}, []),
    ],
)
def test_fixed_vectors(tokens: list[int], bs: int, kwargs: dict[str, object], expected: list[int]) -> None:
    assert block_hashes(tokens, bs, **kwargs) == expected  # type: ignore[arg-type]


def test_seeds_sequences_and_multimodal() -> None:
    assert hash64(b"test data", 1337) == 13226331709069118873
    assert iv("adapter-a") == 8842669519798868182
    assert iv(None, "tenant-a") == 1948188790972764086
    assert iv("adapter-a", "tenant-a") == 10790858310771630931
    assert iv("sql-lora") == 10034886934280409050
    assert iv("", "") == 1337
    assert sequence_hashes(block_hashes(list(range(1, 13)), 4)) == [
        14643705804678351452, 4945711292740353085, 12583592247330656132]
    assert sequence_hashes(block_hashes(list(range(32)), 16)) == [
        15310707395893867146, 13769157705258532664]
    assert multimodal_block_hash([0, 1], [42], 1337) == 6100948656312251355
    assert multimodal_block_hash([0, 1], [42, 7], 1337) == 14276852609691940483


def test_tokens_outside_u32_are_refused() -> None:
    with pytest.raises(OverflowError):
        block_hashes([1, 2**32], 1)


def test_keyed_tracking_hashes_match_dynamos_vector() -> None:
    """`keyed-xxh3-v1` (Dynamo's `keyed_hash_vector_pins_scope_and_chain_framing`): the scope's seeds
    come from keyed BLAKE3; each scope member changes them; the index's block hashes stay public."""
    import random

    from selection_proto import SelectAndReserveRequest, SelectionService, Settings, WorkerRequest
    from selection_proto.core.bookings.tracking import KeyedTracking

    tracking = KeyedTracking(b"\x5a" * 32, "2026-01")
    vector = [4363769719052127296, 14998523962162619427, 13920914207884994756]
    assert tracking.sequence(list(range(12)), 4, "model-a", "tenant-a", "cache-a", "adapter-a") == vector
    assert tracking.sequence(list(range(12)), 4, "model-a", "tenant-b", "cache-a", "adapter-a") != vector
    assert KeyedTracking(b"\x5b" * 32, "2026-01").sequence(
        list(range(12)), 4, "model-a", "tenant-a", "cache-a", "adapter-a") != vector
    with pytest.raises(ValueError, match="exactly 32 raw bytes; found 31"):
        KeyedTracking(b"\x5a" * 31, "k")
    settings = Settings(kv_events="push", router_tracking_hash="keyed-xxh3-v1", router_tracking_key_id="2026-01")
    service = SelectionService(settings, random.Random(0), tracking_key=b"\x5a" * 32)
    service.upsert_worker(WorkerRequest(worker_id=1, model_name="model-a", tenant_id="tenant-a",
                                        endpoint="http://w1", block_size=4), now=0.0)
    answer = service.select_and_reserve(SelectAndReserveRequest(
        model_name="model-a", tenant_id="tenant-a", reservation_id="r", token_ids=list(range(12)),
        cache_namespace="cache-a", lora_name="adapter-a"), now=0.0)
    assert [h % (1 << 64) for h in answer.sequence_hashes or ()] == vector  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="requires router_tracking_key_file"):
        SelectionService(settings)


def test_multimodal_prompt_blocks_match_1_6_1() -> None:
    """`mm_routing_info` replaces `token_ids` when it has tokens; a block's `mm_hash` values are
    hashed after its tokens, sorted (vectors observed on 1.6.1)."""
    import random

    from selection_proto import SelectAndReserveRequest, SelectionService, Settings, WorkerRequest
    from selection_proto.core.base.types import BlockExtraInfo, MmObject, MmRoutingInfo

    service = SelectionService(Settings(kv_events="push"), random.Random(0))
    service.upsert_worker(WorkerRequest(worker_id=1, endpoint="http://w1", block_size=4), now=0.0)

    def booked(rid: str, **prompt: object) -> tuple[list[int], int]:
        answer = service.select_and_reserve(SelectAndReserveRequest(reservation_id=rid, **prompt), now=0.0)
        return list(answer.sequence_hashes or ()), answer.isl_tokens or 0  # type: ignore[union-attr]

    def info(*hashes: int) -> BlockExtraInfo:
        return BlockExtraInfo(mm_objects=[MmObject(mm_hash=h, offsets=[[0, 1]]) for h in hashes])

    routing = list(range(10, 18))
    assert booked("a", token_ids=[1], mm_routing_info=MmRoutingInfo(
        routing_token_ids=routing, block_mm_infos=[info(42)])) == ([5748563526305030929, -5847508800843096957], 8)
    assert booked("b", mm_routing_info=MmRoutingInfo(routing_token_ids=routing, block_mm_infos=[info(7, 42)]))[0] == [
        -4983250488678060218, -1204099627517821879]
    assert booked("c", token_ids=[1, 2, 3, 4], mm_routing_info=MmRoutingInfo(routing_token_ids=[])) == (
        [-3803038269031200164], 4)


@pytest.mark.parametrize("blocks", [1, 63, 64, 65, 127, 128, 200, 8192 + 3])
@pytest.mark.parametrize("bs", [1, 3, 16])
def test_blocks_cut_in_groups_hash_as_one_by_one(blocks: int, bs: int) -> None:
    """Blocks are cut out of the packed prompt many at a time: every count, around the group
    size and with a partial tail, hashes as block-by-block slicing does."""
    import random
    import struct

    rng = random.Random(blocks * 31 + bs)
    tokens = [rng.randrange(2**32) for _ in range(blocks * bs + bs // 2)]
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    step = bs * 4
    expected = [hash64(packed[i * step:(i + 1) * step], 1337) for i in range(blocks)]
    assert block_hashes(tokens, bs) == expected
