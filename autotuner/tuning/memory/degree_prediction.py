"""A tensor-parallel degree's memory predicted from the profile at degree 1 (issue 80, part 1).

The profile at degree 1 measured what the plan would split (runtime/measure/profile.py
`watch_split_regions`): the parameters of its column- and row-wise Linears and the activation
bytes saved inside its split regions, from a column-wise layer's output to the next row-wise
layer's input. At degree k a rank holds the rest whole and 1/k of those; the analytic model
costs that (ModelProfile.tensor_parallel and split_num_params), and what degree 1's launches
measured beyond the analytic model (its fitted residual) is carried over unchanged: the
allocator, the logits of a head the plan leaves whole. Pure functions.
"""

from __future__ import annotations

from dataclasses import replace

from autotuner.tuning.memory.estimate import ModelProfile


def profile_at_degree(profile: ModelProfile, degree: int) -> ModelProfile | None:
    """`profile` (measured at degree 1) as a rank at `degree` would hold the model; None where the
    profile is not degree 1's or says nothing would split."""
    if profile.tensor_parallel > 1 or profile.splittable_num_params <= 0 or degree <= 1:
        return None
    split = min(profile.split_activation_bytes_per_sample, profile.activation_bytes_per_sample)
    return replace(profile, tensor_parallel=degree, split_num_params=profile.splittable_num_params,
                   activation_bytes_per_sample=profile.activation_bytes_per_sample - split + -(-split // degree),
                   activation_bytes_per_sample_by_policy=(), peak_fits=(), splittable_num_params=0,
                   split_activation_bytes_per_sample=0)
