"""Pipeline parallelism, shaped like ``torch.distributed.pipelining``: ``PipelineStage``,
``split``, and the schedules GPipe, 1F1B, interleaved 1F1B, zero bubble (ZB-H1), interleaved
zero bubble and looped BFS, whose action lists come from C++ (csrc/parallel/pipeline/). See
docs/pipeline.md."""
from torchpar.parallel.pipeline.schedules import (Schedule1F1B, ScheduleFromCSV, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                  ScheduleLoopedBFS, ScheduleZeroBubble, get_schedule_class)
from torchpar.parallel.pipeline.pipe import Pipe, SplitPoint, pipeline
from torchpar.parallel.pipeline.split import split
from torchpar.parallel.pipeline.stage import PipelineStage

__all__ = ["PipelineStage", "split", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "ScheduleInterleavedZeroBubble", "ScheduleLoopedBFS", "ScheduleFromCSV", "get_schedule_class", "pipeline", "Pipe",
           "SplitPoint"]
