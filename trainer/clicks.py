"""A synthetic click log with a known ground-truth model: the data of ``pstrain demo --model wide_deep``.

Numpy only, deterministic per seed (every worker regenerates the same log).
Each example is an impression of an item to a user, with the item's category,
and a click label drawn from a known logistic model:

    P(click) = sigmoid(b0 + b_user + b_item + b_category + <p_user, q_item>)

with per-user and per-item biases and 4-d vectors (normal, fixed by the seed).
Users and items are drawn from power laws (``P(rank r) ~ (r + 1) ** -zipf``):
a few are everywhere, most appear once, as in production logs. Ids are not
ranks: each user and item gets a random 63-bit id (what a dynamic table is
for: ids from a huge, unknown space), and the category is a string (a raw
feature value). Each example also carries the dense rank indices
(``user_index`` ...) for the local baseline, which uses full-size tables.

``best_auc`` is the AUC of the true click probabilities on the test labels:
no model scores higher on this test set, except by luck.

>>> log = generate(num_train=1000, num_test=500, num_users=100, num_items=50, num_categories=5)
>>> sorted(log.train)
['category', 'category_index', 'item', 'item_index', 'user', 'user_index']
>>> log.y_train.shape, log.train["category"][:2].tolist()
((1000, 1), ['cat_0000', 'cat_0004'])
>>> 0.5 < log.best_auc < 1.0, auc(np.array([0, 1, 1]), np.array([0.1, 0.2, 0.2]))
(True, 1.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pscore.placement import mix64

LATENT_DIM = 4
_BIAS = -1.5  # b0: about one click in four
_SCALE = 0.6  # stddev of the biases and of the latent vectors' entries


@dataclass(frozen=True, slots=True)
class ClickLog:
    """Train and test examples (feature name -> array of shape ``[n]``) and labels ``[n, 1]``."""

    train: dict[str, np.ndarray]
    y_train: np.ndarray
    test: dict[str, np.ndarray]
    y_test: np.ndarray
    test_probability: np.ndarray  # the true P(click) of each test example
    num_users: int
    num_items: int
    num_categories: int

    @property
    def best_auc(self) -> float:
        """The AUC of the ground truth itself on the test labels (what no model can beat)."""
        return auc(self.y_test, self.test_probability)

    def distinct(self) -> dict[str, int]:
        """Distinct users, items and categories in the training examples."""
        return {k: int(np.unique(self.train[k]).size) for k in ("user", "item", "category")}


def _power_law(rng: np.random.Generator, n: int, size: int, zipf: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** zipf
    return rng.choice(n, size=size, p=p / p.sum()).astype(np.int32)


def _ids(ranks: np.ndarray, seed: int) -> np.ndarray:
    """Random-looking positive 63-bit ids of ranks (distinct in practice)."""
    return (mix64(ranks.astype(np.int64), seed) >> np.uint64(1)).astype(np.int64)


def generate(
    num_train: int = 500_000,
    num_test: int = 50_000,
    *,
    num_users: int = 2_000_000,
    num_items: int = 200_000,
    num_categories: int = 100,
    zipf: float = 0.9,
    seed: int = 0,
) -> ClickLog:
    """The click log (train and test drawn from the same distribution).

    Raises:
        ValueError: a size below 1.
    """
    if min(num_train, num_test, num_users, num_items, num_categories) < 1:
        raise ValueError("the click log's sizes must be >= 1")
    rng = np.random.default_rng(seed)
    user_bias = rng.normal(0, _SCALE, num_users).astype(np.float32)
    item_bias = rng.normal(0, _SCALE, num_items).astype(np.float32)
    cat_bias = rng.normal(0, _SCALE, num_categories).astype(np.float32)
    user_vec = rng.normal(0, _SCALE, (num_users, LATENT_DIM)).astype(np.float32)
    item_vec = rng.normal(0, _SCALE, (num_items, LATENT_DIM)).astype(np.float32)
    item_cat = (mix64(np.arange(num_items), seed + 7) % np.uint64(num_categories)).astype(np.int32)
    names = np.array([f"cat_{c:04d}" for c in range(num_categories)])

    def draw(n: int) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        u = _power_law(rng, num_users, n, zipf)
        i = _power_law(rng, num_items, n, zipf)
        c = item_cat[i]
        logit = _BIAS + user_bias[u] + item_bias[i] + cat_bias[c] + np.sum(user_vec[u] * item_vec[i], axis=1)
        prob = 1.0 / (1.0 + np.exp(-logit))
        y = (rng.random(n) < prob).astype(np.float32).reshape(-1, 1)
        features = {
            "user": _ids(u, seed + 1),
            "item": _ids(i, seed + 2),
            "category": names[c],
            "user_index": u,
            "item_index": i,
            "category_index": c,
        }
        return features, y, prob.astype(np.float32)

    train, y_train, _ = draw(num_train)
    test, y_test, prob = draw(num_test)
    return ClickLog(train, y_train, test, y_test, prob, num_users, num_items, num_categories)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The area under the ROC curve (the Mann-Whitney statistic; tied scores count half).

    Raises:
        ValueError: the labels are all of one class.
    """
    positive = np.asarray(labels).reshape(-1) > 0.5
    scores = np.asarray(scores, np.float64).reshape(-1)
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if not n_pos or not n_neg:
        raise ValueError("AUC needs both positive and negative labels")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    ranks = ((ends - counts + 1 + ends) / 2.0)[inverse]  # 1-based, ties averaged
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))
