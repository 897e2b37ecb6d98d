"""tf_keras/distribute/keras_correctness_test_base.py, translated: the same model trained with and
without a strategy gives the same weights, history, evaluation and predictions.

``run_correctness_test`` follows TF's: the model is built once (seeded) and its initial weights
given to both runs; each run fits, evaluates, predicts, then fits and evaluates again (the user's
flow); the results are compared with TF's tolerances (4e-5; 1e-3 with a partial last batch in
training; BatchNormalization without synchronisation must differ on more than one replica, as
TF's ``assertRaises(AssertionError)`` says). Inputs are numpy arrays or, where TF uses a
``tf.data`` dataset, a DataLoader of global batches.

Every replica's results must equal the chief's bit for bit; the chief alone computes the run
without a strategy and compares. Sizes are TF's divided by about 80 so that a case costs a fraction
of a second: TF's 9,984 rows (156 batches of 64) are 128 (2 batches), its 10,000 (a last batch of
16) are 144; the global batch stays 64. The properties compared do not depend on the number of steps.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from tf_conformance.keras.common import all_close, loader, replicas_agree, seed

GLOBAL_BATCH_SIZE = 64  # TF's _GLOBAL_BATCH_SIZE
EVAL_STEPS = 2  # TF's _EVAL_STEPS is 20


def _size(x: Any) -> int:
    if isinstance(x, dict):
        return len(next(iter(x.values())))
    if isinstance(x, (list, tuple)):
        return len(x[0])
    return len(x)


def correctness_inputs(
    use_numpy: bool, use_validation_data: bool, x_train, y_train, x_eval, y_eval, x_predict, training_epochs: int
) -> tuple[dict, dict | None, dict]:
    """TF's ``get_correctness_test_inputs`` (the batch size is global under every strategy here)."""
    batch_size = GLOBAL_BATCH_SIZE
    if use_numpy:
        training = {"batch_size": batch_size, "x": x_train, "y": y_train, "epochs": training_epochs, "shuffle": False}
        if use_validation_data:
            evaluation = None
            training["validation_data"] = (x_eval, y_eval)
        else:
            evaluation = {"batch_size": batch_size, "x": x_eval, "y": y_eval}
        return training, evaluation, {"x": x_predict}
    training = {"x": loader(x_train, y_train, batch_size=batch_size), "epochs": training_epochs, "shuffle": False}
    eval_data = loader(x_eval, y_eval, batch_size=batch_size)
    if use_validation_data:
        evaluation = None
        training["validation_data"] = eval_data
    else:
        evaluation = {"x": eval_data}
    predict = {"x": loader(x_predict, batch_size=_size(x_predict))}
    return training, evaluation, predict


def fit_eval_and_predict(initial_weights, inputs, model_fn, strategy=None, is_stateful_model=False) -> dict:
    """TF's ``fit_eval_and_predict``: fit, evaluate, weights, predict; fit and evaluate again."""
    training, evaluation, predict = inputs
    model = model_fn(initial_weights=initial_weights, distribution=strategy)
    result: dict[str, Any] = {"training_history_1": model.fit(verbose=0, **training).history}
    if evaluation is not None:
        result["eval_result_1"] = model.evaluate(verbose=0, **evaluation)
    result["weights_1"] = model.get_weights()
    for i in range(3 if is_stateful_model else 1):
        result[f"predict_result_{i}"] = model.predict(verbose=0, **predict)
    result["training_history_2"] = model.fit(verbose=0, **training).history
    if evaluation is not None:
        result["eval_result_2"] = model.evaluate(verbose=0, **evaluation)
    result["weights_2"] = model.get_weights()
    return result


def compare_results(with_ds: dict, without_ds: dict, partial_last_batch: str | None = None) -> None:
    """TF's ``compare_results``: every result within TF's tolerance; with a partial last batch the
    loss of ``evaluate`` and ``val_loss`` are left out, as TF leaves them out."""
    tolerance = 1e-3 if partial_last_batch == "train_and_eval" else 4e-5
    for key in sorted(with_ds):
        got, expected = with_ds[key], without_ds[key]
        if partial_last_batch is not None:
            if key.startswith("eval_result"):
                got, expected = got[1:], expected[1:]
            if key.startswith("training_history"):
                got = {**got, "val_loss": 0}
                expected = {**expected, "val_loss": 0}
        all_close(got, expected, atol=tolerance, rtol=tolerance, what=key)


def run_correctness_test(
    strategy: Any,
    get_model: Callable[..., Any],
    get_data: Callable[[], tuple],
    use_numpy: bool,
    use_validation_data: bool,
    with_batch_norm: str | None = None,
    is_stateful_model: bool = False,
    partial_last_batch: str | None = None,
    training_epochs: int = 2,
) -> None:
    """TF's ``run_correctness_test`` (``get_data`` returns TF's ``get_data`` or, with
    ``partial_last_batch``, ``get_data_with_partial_last_batch[_eval]``'s five arrays)."""
    seed()
    data = get_data()
    if len(data) == 3:
        x_train, y_train, x_predict = data
        x_eval, y_eval = x_train, y_train
    else:
        x_train, y_train, x_eval, y_eval, x_predict = data
    # Built once, without a strategy: both runs start from these weights.
    initial_weights = get_model(initial_weights=None, distribution=None).get_weights()

    def inputs() -> tuple:
        return correctness_inputs(
            use_numpy, use_validation_data, x_train, y_train, x_eval, y_eval, x_predict, training_epochs
        )

    with_ds = fit_eval_and_predict(initial_weights, inputs(), get_model, strategy, is_stateful_model)
    replicas_agree(strategy, with_ds, "results under the strategy")
    if strategy.extended.process_index != 0:
        return  # every replica holds the chief's results (checked above): the chief compares them
    without_ds = fit_eval_and_predict(initial_weights, inputs(), get_model, None, is_stateful_model)
    if with_batch_norm == "regular" and strategy.num_replicas_in_sync > 1:
        # Each replica normalises its own part of the batch: the results differ from one device's.
        try:
            compare_results(with_ds, without_ds, partial_last_batch)
        except AssertionError:
            return
        raise AssertionError("BatchNormalization without synchronisation gave one device's results on several replicas")
    compare_results(with_ds, without_ds, partial_last_batch)


def embedding_data(
    count: int = GLOBAL_BATCH_SIZE * EVAL_STEPS,
    min_words: int = 5,
    max_words: int = 10,
    max_word_id: int = 19,
    num_classes: int = 2,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TF's ``TestDistributionStrategyEmbeddingModelCorrectnessBase.get_data``: padded word ids, labels."""
    distribution = []
    for _ in range(num_classes):
        dist = np.abs(np.random.randn(max_word_id))
        distribution.append(dist / np.sum(dist))
    features, labels = [], []
    for _ in range(count):
        label = np.random.randint(0, num_classes, size=1)[0]
        num_words = np.random.randint(min_words, max_words, size=1)[0]
        features.append(np.random.choice(max_word_id, size=num_words, replace=True, p=distribution[label]))
        labels.append(label)
    padded = np.zeros((count, max_words), dtype=np.float32)
    for i, words in enumerate(features):  # keras.utils.pad_sequences: zeros before, the words last
        padded[i, max_words - len(words) :] = words
    x_train = padded.astype(np.int32)
    y_train = np.asarray(labels, dtype=np.int32).reshape((count, 1))
    return x_train, y_train, x_train[:GLOBAL_BATCH_SIZE]
