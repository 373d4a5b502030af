"""Reading and writing safetensors checkpoints: headers, index, lazy tensor reads, atomic writes."""

from kvq.checkpoint.header import ShardHeader, TensorInfo, read_header
from kvq.checkpoint.reader import Checkpoint

__all__ = ["Checkpoint", "ShardHeader", "TensorInfo", "read_header"]
