"""Test host only: a memory hog. Grows by 8 MiB every 0.1 s up to argv[1] MiB, touching every page
(resident, not just reserved), then holds it."""

import sys
import time

cap, chunks = int(sys.argv[1]) << 20, []
while sum(map(len, chunks)) < cap:
    c = bytearray(8 << 20)
    for i in range(0, len(c), 4096):
        c[i] = 1
    chunks.append(c)
    time.sleep(0.1)
print("hog holding", sum(map(len, chunks)) >> 20, "MiB", flush=True)
time.sleep(3600)
