"""Which layers each pipeline stage holds, by DeepSpeed's `partition_method`. Parts are the stage
boundaries: stage s holds layers parts[s] to parts[s+1] (exclusive), as DeepSpeed counts them.

- "uniform": the same number of layers per stage, the first stages one more where they do not divide;
- "parameters" (DeepSpeed's default): balanced by each layer's trainable parameter count;
- "type:REGEX": balanced by the layers whose class name matches REGEX (case-insensitively, anywhere
  in the name), so each stage gets about as many of them.
DeepSpeed's balanced split minimises the spread between the heaviest and the lightest stage (not
the heaviest alone), taking the later boundary on a tie; so does this one, so a script's stages
hold the layers they hold under DeepSpeed."""

from __future__ import annotations

import math
import re
from typing import Sequence

from autotuner.core.errors import ConfigError


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts minimising (heaviest part - lightest part); every part non-empty where
    there are more items than parts. A dynamic programme over (items, parts)."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[i][j]: (spread, heaviest, lightest, cut) over the first i items in j parts
    best = [[(inf, inf, inf, -1)] * (num_parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf, -1)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            chosen = (inf, inf, inf, -1)
            for k in range(i):
                spread_k, heavy_k, light_k, _ = best[k][j - 1]
                if spread_k == inf:
                    continue
                part = prefix[i] - prefix[k]
                heavy, light = max(heavy_k, part), min(light_k, part)
                if heavy - light <= chosen[0]:  # a tie takes the later cut
                    chosen = (heavy - light, heavy, light, k)
            best[i][j] = chosen
    parts, i = [n], n
    for j in range(num_parts, 0, -1):
        i = best[i][j][3]
        parts.append(i)
    return parts[::-1]


def parts_for(method: str, layer_names: Sequence[str], layer_params: Sequence[int], num_stages: int) -> list[int]:
    """The stage boundaries for `method` over layers with these class names and trainable
    parameter counts; an unknown method or a regex matching no layer: one line (ConfigError)."""
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(len(layer_names), num_stages)
    if lowered == "parameters":
        return partition_balanced(layer_params, num_stages)
    if lowered.startswith("type:"):
        pattern = lowered.split(":")[1]
        regex = re.compile(pattern, re.IGNORECASE)
        hits = [1 if name and regex.search(name) else 0 for name in layer_names]
        if not any(hits):
            raise ConfigError(f"PipelineModule(partition_method={method!r}): '{pattern}' matches no layer's class "
                              f"name (layers: {', '.join(sorted(set(n for n in layer_names if n)))}); name a layer "
                              "class the model has, or use \"parameters\" or \"uniform\"")
        return partition_balanced(hits, num_stages)
    raise ConfigError(f"PipelineModule(partition_method={method!r}): not a method; expected \"parameters\", "
                      "\"uniform\" or \"type:REGEX\" (DeepSpeed's \"profile\" is not implemented there either)")
