"""Capsules and their store: tiers (gpu, host, disk), moves between them, prefix blocks shared by
reference, the prefix cache, the on-disk format."""
from capsulert.capsule_store.blocks import BlockLayout, BlockRefs, Parts
from capsulert.capsule_store.capsule import (
    CapsuleInfo,
    CapsuleMeta,
    CapsuleRef,
    TensorSpec,
    tensor_nbytes,
    tensor_specs,
    token_digest,
    validate_name,
)
from capsulert.capsule_store.format.checksum import tensors_checksum
from capsulert.capsule_store.format.names import capsule_file_name
from capsulert.capsule_store.format.disk import (
    read_capsule, read_capsule_origin, read_header, write_capsule, write_capsule_with_meta)
from capsulert.capsule_store.store import CapsuleStore

__all__ = [
    "BlockLayout",
    "BlockRefs",
    "Parts",
    "CapsuleInfo",
    "CapsuleMeta",
    "CapsuleRef",
    "CapsuleStore",
    "TensorSpec",
    "capsule_file_name",
    "read_capsule",
    "read_capsule_origin",
    "read_header",
    "tensor_nbytes",
    "tensor_specs",
    "tensors_checksum",
    "token_digest",
    "validate_name",
    "write_capsule",
    "write_capsule_with_meta",
]
