"""`deepspeed.runtime.data_pipeline.data_routing.helper` (random-LTD): importable, refused when used."""

from autotuner.unsupported import unsupported_function

convert_to_random_ltd = unsupported_function("runtime.data_pipeline.data_routing.helper.convert_to_random_ltd",
                                             "data_pipeline")
save_without_random_ltd = unsupported_function("runtime.data_pipeline.data_routing.helper.save_without_random_ltd",
                                               "data_pipeline")
remove_random_ltd_state_dict = unsupported_function(
    "runtime.data_pipeline.data_routing.helper.remove_random_ltd_state_dict", "data_pipeline")
