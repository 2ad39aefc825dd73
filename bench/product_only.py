"""The product path alone (embedded Redis, producer, worker, engine), no HF peers: for comparing
engine settings on the GPU machine. Prints one JSON line.

    python bench/product_only.py IMAGES BATCH_SIZE '{"overlap_vision": true}'
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from wicore.bench.bench_images import make_images
from wicore.bench.caption_bench import CaptionBench, run_product
from wicore.models.gemma3 import make_gemma3_4b

if __name__ == "__main__":
    images, batch, options = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    work = Path("/tmp/product-only")
    bench = CaptionBench(workdir=work, images=images, batch_size=batch, engine_options=options)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_gemma3_4b(work / "gemma3-4b")
    paths = make_images(work / "images", bench.warmup_images + images, processes=16)
    result = run_product(bench, model_dir, paths, work / "worker.log")
    stats = result["engine_stats"]
    keep = ("vision_s", "prefill_s", "decode_s", "decode_steps", "mean_decode_batch", "steps")
    print(
        json.dumps(
            {
                "options": options,
                "batch_size": batch,
                "images_per_s": result["images_per_s"],
                "worker_start_s": result["worker_start_s"],
                **{k: stats.get(k) for k in keep},
            }
        )
    )
