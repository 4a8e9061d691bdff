"""`deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset`: importable, refused when used."""

from autotuner.deepspeed_paths.unsupported import unsupported_class, unsupported_function

MMapIndexedDataset = unsupported_class("runtime.data_pipeline.data_sampling.indexed_dataset.MMapIndexedDataset",
                                       "data_pipeline")
make_builder = unsupported_function("runtime.data_pipeline.data_sampling.indexed_dataset.make_builder",
                                    "data_pipeline")
make_dataset = unsupported_function("runtime.data_pipeline.data_sampling.indexed_dataset.make_dataset",
                                    "data_pipeline")
