# SPDX-License-Identifier: Apache-2.0
"""A Python program that leaks from a known function through cuma.Heap, logged with
trace:LOG,trace_stacks:on for check_leaks_native.py --python: each of 12 iterations
leaky_cache() keeps 1 MiB it never frees and forward() takes 3 MiB it frees before the
iteration ends.

usage: leak_python.py LOG (the cuma package importable, CUMA_LIBRARY naming libcuma.so)
"""
import sys

import cuma

MB = 1 << 20


def leaky_cache(heap, kept):
    kept.append(heap.alloc(MB))  # LEAK


def forward(heap):
    a = heap.alloc(3 * MB)  # ACTIVATIONS
    heap.free(a)


def main():
    conf = "backend:sim,capacity:256M,release_thread:off,trace:%s,trace_stacks:on" % sys.argv[1]
    kept = []
    with cuma.Heap(conf, use_env=False) as heap:
        for _ in range(12):
            forward(heap)
            leaky_cache(heap, kept)
    # Closing the heap logs no frees: the 12 MiB are still live in the log.


if __name__ == "__main__":
    main()
