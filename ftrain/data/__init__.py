"""Data (`ft.data`): `make_batches`, collation, streams with exact resume, packing and mixing."""

from ftrain.data._batches import find_batch_size as find_batch_size
from ftrain.data._batches import is_out_of_memory as is_out_of_memory
from ftrain.data._batches import make_batches as make_batches
from ftrain.data._collate import pack_examples as pack_examples
from ftrain.data._collate import pad_collate as pad_collate
from ftrain.data._common import Collate as Collate
from ftrain.data._common import MicroBatches as MicroBatches
from ftrain.data._common import Source as Source
from ftrain.data._common import StepData as StepData
from ftrain.data._common import StepSpan as StepSpan
from ftrain.data._common import ZeroWeight as ZeroWeight
from ftrain.data._common import epoch_order as epoch_order
from ftrain.data._common import is_stream as is_stream
from ftrain.data._common import length_grouped_order as length_grouped_order
from ftrain.data._common import num_micro_batches as num_micro_batches
from ftrain.data._common import resumed_at as resumed_at
from ftrain.data._common import run_loader as run_loader
from ftrain.data._common import seeded as seeded
from ftrain.data._common import step_data as step_data
from ftrain.data._common import step_span as step_span
from ftrain.data._common import weighted as weighted
from ftrain.data._position import check_position as check_position
from ftrain.data._position import unchecked as unchecked
from ftrain.data._stream import IterableRows as IterableRows
from ftrain.data._stream import mix as mix
from ftrain.data._stream import pack as pack
from ftrain.data._stream import stream as stream

__all__ = [
    "Collate",
    "IterableRows",
    "MicroBatches",
    "Source",
    "StepData",
    "StepSpan",
    "ZeroWeight",
    "check_position",
    "epoch_order",
    "find_batch_size",
    "is_out_of_memory",
    "is_stream",
    "length_grouped_order",
    "make_batches",
    "mix",
    "num_micro_batches",
    "pack",
    "pack_examples",
    "pad_collate",
    "resumed_at",
    "run_loader",
    "seeded",
    "step_data",
    "step_span",
    "stream",
    "unchecked",
    "weighted",
]
