import random


def sim(n, k, policy, T=400.0, p_stall=0.02, stall=0.5, seed=0):
    rng = random.Random(seed)

    # each worker: queue of shards for current round + next
    def new_round(w):
        if policy == "random":
            o = list(range(k))
            rng.shuffle(o)
            return o
        start = w % k
        return [(start + j) % k for j in range(k)]

    queue = [new_round(w) for w in range(n)]
    left = [1.0] * n  # part remaining
    stall_left = [0.0] * n
    elapsed_part = [0.0] * n
    done = [0] * n
    t = 0.0
    busy = [0.0] * k
    dt = 0.01
    while t < T:
        cnt = [0] * k
        for w in range(n):
            if stall_left[w] <= 0:
                cnt[queue[w][0]] += 1
        for s in range(k):
            if cnt[s]:
                busy[s] += dt
        for w in range(n):
            if stall_left[w] > 0:
                stall_left[w] -= dt
                continue
            s = queue[w][0]
            left[w] -= dt / cnt[s]
            elapsed_part[w] += dt
            if left[w] <= 0:
                slow = elapsed_part[w] > 1.5
                queue[w].pop(0)
                done[w] += 1
                if not queue[w]:
                    queue[w] = new_round(w)
                if policy == "swap" and slow and len(queue[w]) >= 2 and rng.random() < 0.5:
                    queue[w][0], queue[w][1] = queue[w][1], queue[w][0]
                if policy == "skip" and slow and rng.random() < 0.5:
                    # move current next to the end of the round
                    queue[w].append(queue[w].pop(0)) if len(queue[w]) > 1 else None
                left[w] = 1.0
                elapsed_part[w] = 0.0
                if rng.random() < p_stall:
                    stall_left[w] = rng.random() * stall
        t += dt
    return sum(done) / n / T, sum(busy) / k / T


for n, k in ((16, 16), (32, 16), (16, 8), (32, 32)):
    for pol in ("cyclic", "random", "swap", "skip"):
        r = [sim(n, k, pol, seed=s) for s in range(3)]
        print(
            n,
            k,
            pol,
            f"parts/unit per worker (bound {min(1, k / n):.2f}):",
            [round(x[0], 3) for x in r],
            "shard busy",
            [round(x[1], 2) for x in r],
        )
