"""The digest behind weights_match: equal iff names, dtypes, shapes and every byte agree."""

from __future__ import annotations

import threading

import torch

from timeshare.engines.digest import ALGORITHM, WeightsDigest, tensor_hash, weights_digest

# XXH3-128 of no bytes, seed 0 (xxHash's own test vectors): the hash is the one we name.
XXH3_128_OF_NOTHING = "99aa06d3014798d86001c324468d497f"


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layers.0.mlp.weight": torch.randn(32, 32, generator=gen).to(torch.bfloat16),
        "norm.weight": torch.ones(32, dtype=torch.float16),
    }


def test_the_hash_is_xxh3_128_of_the_bytes() -> None:
    assert tensor_hash(torch.empty(0)) == XXH3_128_OF_NOTHING
    assert weights_digest(weights().items()).startswith(f"{ALGORITHM}:")


def test_equal_weights_in_any_order_give_equal_digests() -> None:
    named = weights()
    forward = weights_digest(named.items())
    assert weights_digest(reversed(list(named.items()))) == forward
    assert weights_digest((n, t.clone()) for n, t in named.items()) == forward


def test_one_flipped_bit_changes_the_digest() -> None:
    named = weights()
    before = weights_digest(named.items())
    flipped = named["layers.0.mlp.weight"].clone()
    flipped.view(torch.int16)[17, 3] ^= 1  # the lowest mantissa bit of one bf16
    named["layers.0.mlp.weight"] = flipped
    assert weights_digest(named.items()) != before


def test_name_dtype_and_shape_are_part_of_the_digest() -> None:
    named = weights()
    before = weights_digest(named.items())
    embed = named.pop("embed.weight")
    assert weights_digest([*named.items(), ("embed.weights", embed)]) != before
    assert weights_digest([*named.items(), ("embed.weight", embed.view(32, 64))]) != before
    same_bytes = embed.view(torch.int32)
    assert weights_digest([*named.items(), ("embed.weight", same_bytes)]) != before
    assert weights_digest(named.items()) != before  # a missing tensor


def test_a_strided_view_hashes_as_its_values() -> None:
    matrix = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_hash(matrix.t()) == tensor_hash(matrix.t().contiguous())
    assert tensor_hash(matrix.t()) != tensor_hash(matrix)


def test_tensors_added_from_several_threads_all_count() -> None:
    named = list(weights().items())
    digest = WeightsDigest()
    threads = [threading.Thread(target=digest.add, args=item) for item in named]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert digest.hexdigest() == weights_digest(named)


def test_hashing_a_parameter_leaves_its_storage_resizable() -> None:
    # OFFLOAD frees a parameter's storage by resizing it: a hash that exported the tensor to
    # numpy would have marked that storage not resizable for good (a trainer sending its own
    # replicated parameters, Megatron's norms, then failed at offload_params).
    parameter = torch.nn.Parameter(torch.randn(64))
    tensor_hash(parameter)
    assert parameter.untyped_storage().resizable()
    parameter.untyped_storage().resize_(0)
