"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: importable, refused when used."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

CurriculumScheduler = unsupported_class("runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler",
                                        "data_pipeline")
