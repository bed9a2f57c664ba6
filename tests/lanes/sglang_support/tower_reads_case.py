"""Child process: upstream's device->host reads of sglang's Qwen2.5-VL tower alone for the image of
tests/lanes/engine_support/tiny_vl.py, measured as tests/lanes/test_sglang_towers.py measures them
(npu_shim.testing.sglang_towers: the tower built from a saved model's vision config, the shim
uninstalled for the forward, ``count_host_syncs`` over CPU stand-ins).

A child, because the towers' set-up publishes sglang's server arguments and opens a one-rank process
group for the life of its process: done in the test process, it changed what later test files there
found. argv: the model folder. Prints ``UPSTREAM_TOWER_READS <count>``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/lanes


def main(model_dir):
    import torch
    from engine_support import tiny_vl
    from transformers import AutoConfig

    from npu_shim.testing import sglang_towers

    sglang_towers.setup()
    tower = sglang_towers.build("Qwen2.5-VL", torch.bfloat16,
                                vision_config=AutoConfig.from_pretrained(model_dir).vision_config)
    grid = tiny_vl.processed(model_dir)["image_grid_thw"].tolist()
    _, syncs, _ = sglang_towers.forward("Qwen2.5-VL", tower, sglang_towers.pixel_values(tower, grid), grid,
                                        upstream=True)
    print("UPSTREAM_TOWER_READS %d" % syncs.count, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)
