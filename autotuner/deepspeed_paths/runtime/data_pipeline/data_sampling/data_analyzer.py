"""`deepspeed.runtime.data_pipeline.data_sampling.data_analyzer`: importable, refused when used."""

from autotuner.deepspeed_paths.unsupported import unsupported_class

DataAnalyzer = unsupported_class("runtime.data_pipeline.data_sampling.data_analyzer.DataAnalyzer", "data_pipeline")
DistributedDataAnalyzer = unsupported_class(
    "runtime.data_pipeline.data_sampling.data_analyzer.DistributedDataAnalyzer", "data_pipeline")
