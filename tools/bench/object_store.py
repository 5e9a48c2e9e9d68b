"""The object-store row: our async save to an S3 endpoint against boto3's multipart upload.

In one run, alternating per repeat, every rank

* saves its shard of a synthetic sharded state dict with
  ``TorchDistAsyncSaveStrategy(use_msc=True)`` to ``msc://bench/...`` on an
  :class:`~megatron_async.AsyncCallsQueue`, from the call to the finalize that saw every
  rank's objects acknowledged and wrote the completion markers (the stall, the part
  the training loop waits for, is reported separately);
* uploads the same bytes, already serialized in memory, as plain boto3 multipart uploads:
  as many objects per rank as our writer writes files (``--thread-count``), one thread
  each, the same part size: the ceiling of the endpoint for this shape of traffic.

Throughput is the bytes of all ranks over the slowest rank's time (both sides end with a
barrier). The endpoint is moto's S3 server on 127.0.0.1, started here and stopped
afterwards (moto keeps objects in memory and acknowledges at once: it measures our
client-side path, not a store), or an S3-compatible ``--endpoint`` of your own::

    python tools/benchmark.py --object-store --ranks 2 --bytes-per-rank 256MiB \\
        --repeats 5 --out bench_out/object_store

Prints a table and writes ``object_store.json`` into ``--out``. Tooling only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List

from .config import format_num_bytes, parse_num_bytes
from .launch import RankContext, launch

__all__ = ["main", "object_store_job"]

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_PROFILE = "bench"


def _parse_args(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python tools/benchmark.py --object-store",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--bytes-per-rank", type=parse_num_bytes, default="256MiB")
    parser.add_argument("--tensor-count", type=int, default=64, help="float32 tensors per rank")
    parser.add_argument("--thread-count", type=int, default=2,
                        help="files (writer threads) per rank; the same number of boto3 uploads")
    parser.add_argument("--part-bytes", type=parse_num_bytes, default="16MiB",
                        help="multipart part size of both sides (S3's minimum is 5 MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--caller", choices=["persistent", "temporal"], default="persistent")
    parser.add_argument("--endpoint", default=None,
                        help="an S3-compatible endpoint URL; default: moto's server on 127.0.0.1")
    parser.add_argument("--bucket", default="megatron-async-bench",
                        help="created when missing")
    parser.add_argument("--out", default="bench_out/object_store")
    parser.add_argument("--launch-timeout-s", type=float, default=1800.0)
    args = parser.parse_args(argv)
    if args.part_bytes < 5 << 20:
        parser.error("--part-bytes must be at least 5MiB (S3's smallest part)")
    if min(args.ranks, args.tensor_count, args.thread_count, args.repeats) < 1:
        parser.error("--ranks, --tensor-count, --thread-count and --repeats must be >= 1")
    return args


# -- every rank ------------------------------------------------------------------------------


def _sharded_state(rank: int, world_size: int, num_bytes: int, count: int):
    """``count`` float32 tensors of ``num_bytes`` in all, each split over the ranks."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor

    numel = max(1, num_bytes // 4 // count)
    generator = torch.Generator().manual_seed(rank)
    return {
        f"t{i}": ShardedTensor.from_rank_offsets(
            f"t{i}", torch.rand(numel, generator=generator), (0, rank, world_size)
        )
        for i in range(count)
    }


def _boto3_client(payload: Dict[str, Any], connections: int):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=payload["endpoint"], region_name="us-east-1",
        aws_access_key_id=payload["access_key"], aws_secret_access_key=payload["secret_key"],
        config=Config(max_pool_connections=max(10, connections)),
    )


def _multipart_upload(client, bucket: str, key: str, data: memoryview, part_bytes: int) -> None:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts = []
    for number, start in enumerate(range(0, len(data), part_bytes), start=1):
        body = bytes(data[start:start + part_bytes])
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                  Body=body)["ETag"]
        parts.append({"ETag": etag, "PartNumber": number})
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload,
                                     MultipartUpload={"Parts": parts})


def object_store_job(ctx: RankContext) -> List[Dict[str, float]]:
    """Every rank: per repeat one async save of ours and one boto3 upload, timed."""
    import torch.distributed as dist

    from megatron_async import AsyncCallsQueue, TorchDistAsyncSaveStrategy

    p = ctx.payload
    state = _sharded_state(ctx.rank, ctx.world_size, p["bytes_per_rank"], p["tensor_count"])
    serialized = memoryview(b"".join(t.data.numpy().tobytes() for t in state.values()))
    step = -(-len(serialized) // p["thread_count"])
    files = [serialized[i:i + step] for i in range(0, len(serialized), step)]
    client = _boto3_client(p, len(files))
    queue = AsyncCallsQueue(persistent=p["caller"] == "persistent")
    strategy = TorchDistAsyncSaveStrategy(
        use_msc=True, object_part_bytes=p["part_bytes"], thread_count=p["thread_count"]
    )

    def ours(name: str) -> Dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        request = strategy.async_save(state, f"msc://{_PROFILE}/{p['run']}/{name}")
        queue.schedule_async_request(request)
        scheduled = time.perf_counter()
        queue.maybe_finalize_async_calls(blocking=True)
        dist.barrier()
        return {"stall_s": scheduled - start, "total_s": time.perf_counter() - start}

    def plain(name: str) -> Dict[str, float]:
        dist.barrier()
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(files)) as pool:
            uploads = [
                pool.submit(_multipart_upload, client, p["bucket"],
                            f"{p['run']}/{name}/rank{ctx.rank}_{i}", data, p["part_bytes"])
                for i, data in enumerate(files)
            ]
            for upload in uploads:
                upload.result()
        dist.barrier()
        return {"total_s": time.perf_counter() - start}

    try:
        ours("warmup")  # the worker's start-up and the plan are not part of the row
        rows = []
        for repeat in range(p["repeats"]):
            order = [("ours", ours), ("boto3", plain)]
            if repeat % 2:
                order.reverse()  # neither side always runs on a store holding the other's bytes
            row = {}
            for label, run in order:
                for key, value in run(f"{label}-{repeat}").items():
                    row[f"{label}_{key}"] = value
            rows.append(row)
            if ctx.rank == 0:  # moto keeps every object in memory
                _delete_prefix(client, p["bucket"], f"{p['run']}/")
            dist.barrier()
    finally:
        queue.close()
    return rows


def _delete_prefix(client, bucket: str, prefix: str) -> None:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})


# -- the launching side ----------------------------------------------------------------------


def _summarize(per_rank: List[List[Dict[str, float]]], total_bytes: int) -> Dict[str, Any]:
    """Per repeat the slowest rank's times; medians and throughputs over the repeats."""
    repeats = []
    for i in range(len(per_rank[0])):
        rows = [rank_rows[i] for rank_rows in per_rank]
        repeats.append({key: max(row[key] for row in rows) for key in rows[0]})
    median = {key: statistics.median(r[key] for r in repeats) for key in repeats[0]}
    ours_bps = total_bytes / median["ours_total_s"]
    boto3_bps = total_bytes / median["boto3_total_s"]
    return {
        "repeats": repeats,
        "median": median,
        "ours_bytes_per_s": ours_bps,
        "boto3_bytes_per_s": boto3_bps,
        "ratio": ours_bps / boto3_bps,
    }


def _start_endpoint(args: argparse.Namespace, tmp: str):
    """``(payload fields, server or None)``: the endpoint, its bucket and MSC_CONFIG set."""
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    from tests.object_store import ACCESS_KEY, SECRET_KEY, LoopbackS3Server, s3_client, write_msc_config

    server = None
    endpoint = args.endpoint
    access_key = os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    if endpoint is None:
        server = LoopbackS3Server(os.path.join(tmp, "moto.log")).start()
        endpoint, access_key, secret_key = server.endpoint, ACCESS_KEY, SECRET_KEY
    client = s3_client(endpoint, access_key, secret_key)
    try:
        client.head_bucket(Bucket=args.bucket)
    except Exception:  # missing (or not ours to see): try to create it, which says which
        client.create_bucket(Bucket=args.bucket)
    profile = {"endpoint": endpoint, "bucket": args.bucket,
               "access_key": access_key, "secret_key": secret_key}
    os.environ["MSC_CONFIG"] = write_msc_config(os.path.join(tmp, "msc.json"), {_PROFILE: profile})
    return {"endpoint": endpoint, "bucket": args.bucket, "access_key": access_key,
            "secret_key": secret_key}, server


def main(argv: List[str]) -> int:
    """Run the object-store row and print it (the launching side)."""
    args = _parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        endpoint, server = _start_endpoint(args, tmp)
        try:
            payload = {
                **endpoint, "run": f"run-{os.getpid()}-{int(time.time())}",
                "bytes_per_rank": args.bytes_per_rank, "tensor_count": args.tensor_count,
                "thread_count": args.thread_count, "part_bytes": args.part_bytes,
                "repeats": args.repeats, "caller": args.caller,
            }
            per_rank = launch(args.ranks, object_store_job, payload, args.launch_timeout_s,
                              log_path=os.path.join(args.out, "ranks.log"))
        finally:
            if server is not None:
                server.stop()
    bytes_per_rank = (args.bytes_per_rank // 4 // args.tensor_count) * 4 * args.tensor_count
    summary = _summarize(per_rank, bytes_per_rank * args.ranks)
    where = "moto on 127.0.0.1" if args.endpoint is None else args.endpoint
    result = {
        "endpoint": where, "ranks": args.ranks, "bytes_per_rank": bytes_per_rank,
        "tensor_count": args.tensor_count, "thread_count": args.thread_count,
        "part_bytes": args.part_bytes, "caller": args.caller, **summary,
    }
    with open(os.path.join(args.out, "object_store.json"), "w") as f:
        json.dump(result, f, indent=2)
    median = summary["median"]
    print(f"object store ({where}): {args.ranks} ranks x {format_num_bytes(bytes_per_rank)}, "
          f"{args.thread_count} objects per rank, parts of {format_num_bytes(args.part_bytes)}, "
          f"median of {args.repeats}")
    print(f"  ours ({args.caller} caller)  {format_num_bytes(summary['ours_bytes_per_s'])}/s  "
          f"(save to finalize {median['ours_total_s']:.3f} s, stall {median['ours_stall_s']:.3f} s)")
    print(f"  boto3 multipart         {format_num_bytes(summary['boto3_bytes_per_s'])}/s  "
          f"({median['boto3_total_s']:.3f} s)")
    print(f"  ours / boto3            {summary['ratio']:.2f}")
    return 0
