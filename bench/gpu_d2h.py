"""Checkpoint staging throughput from a GPU vs the pinned-memcpy peak (benchmark; needs CUDA).

On the last visible GPU (not the default device, as a worker with ``LOCAL_RANK`` > 0), with a state
of ``--tensors`` float32 tensors totalling ``--size-mb``:

* ``peak``: one contiguous device-to-host copy into a page-locked buffer (``copy_(non_blocking=True)``
  + synchronize) — what the PCIe/NVLink-C2C link gives;
* ``staging``: the checkpoint stager (``trainguard.checkpoint.staging.Stager``: one exact-size arena
  registered with ``cudaHostRegister``, copies on a side stream) until its event completes.

Best of ``--repeat`` after one warm-up each. Prints a table; ``--json PATH`` writes ``peak_gbps,
staging_gbps, staging_over_peak, staging_bytes, state_bytes``. Without CUDA it prints why and exits 0
(``"skipped"`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=2048)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None, metavar="PATH")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        res = {"skipped": f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda})"}
        print(f"gpu_d2h: SKIPPED: {res['skipped']}")
    else:
        from trainguard.checkpoint.staging import Stager

        device = torch.device("cuda", torch.cuda.device_count() - 1)
        torch.cuda.set_device(device)
        numel = a.size_mb * 2**20 // 4 // a.tensors
        state = {"model": {f"w{i}": torch.randn(numel, device=device) for i in range(a.tensors)}}
        nbytes = numel * 4 * a.tensors
        flat = torch.randn(numel * a.tensors, device=device)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)

        def best(fn) -> float:
            fn()
            times = []
            for _ in range(a.repeat):
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times)

        def peak() -> None:
            host.copy_(flat, non_blocking=True)
            torch.cuda.synchronize(device)

        stager = Stager()

        def staging() -> None:
            stager.stage(state)
            stager.ready.synchronize()

        t_peak, t_stage = best(peak), best(staging)
        res = {"device": torch.cuda.get_device_name(device), "state_bytes": nbytes,
               "staging_bytes": stager.staging_bytes, "peak_gbps": nbytes / t_peak / 1e9,
               "staging_gbps": nbytes / t_stage / 1e9, "staging_over_peak": t_peak / t_stage,
               "rebuilds": stager.rebuilds}
        print(f"gpu_d2h on {res['device']} ({device}), {nbytes / 2**20:.0f} MiB in {a.tensors} tensors")
        print(f"  pinned memcpy peak   {res['peak_gbps']:.1f} GB/s")
        print(f"  checkpoint staging   {res['staging_gbps']:.1f} GB/s  ({res['staging_over_peak']:.2f} of peak)")
        print(f"  staging bytes        {stager.staging_bytes} (state {nbytes})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
