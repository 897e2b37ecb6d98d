# The first seed (tf.distribute driven from R through reticulate), with phalanx in place of TensorFlow.
#
# Run from the clone, with the Python that has phalanx and Keras 3 (docs/r.md):
#
#   KERAS_BACKEND=torch RETICULATE_PYTHON=/path/to/venv/bin/python Rscript examples/r/seed_000.R
#
# Options (after the script, or after `--args` with `Rscript -e 'source(...)'`):
#   --strategies=one_device,central_storage,mirrored,multiworker_mirrored   which of the seed's strategies
#   --epochs=N (default 10)   --dropout=R (default: the seed's 0.4 and 0.3; 0 makes runs comparable)
#   --samples=N (default 4096)
#
# What differs from the seed:
# * `tf <- import("tensorflow")` is `phalanx <- import("phalanx")`, and Keras 3 (torch backend) is
#   called through reticulate (`keras$layers$Dense(...)`) instead of the R keras package;
# * the strategies get their devices: two CPU processes stand in for two GPUs
#   (`list("cpu:0", "cpu:1")`; leave it out on a machine with GPUs). MultiWorkerMirrored, created
#   without TF_CONFIG as in the seed, runs on the replicas the strategies before it started (one
#   worker with two replicas; alone it would be one worker with one). ParameterServer needs a
#   cluster of tasks (TF_CONFIG, `phalanx run --ps`), which an R program cannot be yet: not created;
# * MNIST is replaced by random data of MNIST's shape (784 features, 10 classes; no download);
# * every model is trained and its weights compared with the one-device model's: with dropout 0
#   they match (|difference| < 1e-5), as the replicas split each batch of 128 and sum the gradients;
# * the program ends with closing the strategies: R runs no Python exit handlers, so this is where
#   replica 0 waits for the other replicas and fails if one of them failed.
#
# A multi-replica strategy starts its other replicas as fresh `Rscript` processes that run this
# script again (their output: the log directory the first lines name). Every replica runs every
# line, as every process of a tf.distribute multi-worker job does.

library(reticulate)

options <- list(strategies = "one_device,central_storage,mirrored,multiworker_mirrored", epochs = "10", dropout = "", samples = "4096")
for (arg in commandArgs(trailingOnly = TRUE)) {
  kv <- regmatches(arg, regexec("^--([a-z_]+)=(.*)$", arg))[[1]]
  if (length(kv) != 3 || !(kv[2] %in% names(options))) stop("unknown argument: ", arg)
  options[[kv[2]]] <- kv[3]
}
wanted <- strsplit(options$strategies, ",")[[1]]
epochs <- as.integer(options$epochs)
dropout <- if (nzchar(options$dropout)) rep(as.numeric(options$dropout), 2) else c(0.4, 0.3)

phalanx <- import("phalanx")
keras <- import("keras")

strategy <- list()
# Creating strategies
strategy$one_device <- phalanx$OneDeviceStrategy("cpu:0")
if ("central_storage" %in% wanted) {
  strategy$central_storage <- phalanx$experimental$CentralStorageStrategy(list("cpu:0", "cpu:1"))
}
if ("mirrored" %in% wanted) {
  strategy$mirrored <- phalanx$MirroredStrategy(list("cpu:0", "cpu:1"))
}
if ("multiworker_mirrored" %in% wanted) {
  strategy$multiworker_mirrored <- phalanx$experimental$MultiWorkerMirroredStrategy()
}
replica <- phalanx$interactive$replica_id()

# MNIST's shape: 784 features in [0, 1], 10 classes (a fixed linear rule, so that there is
# something to learn); the same on every replica.
set.seed(42)
n <- as.integer(options$samples)
x_train <- matrix(runif(n * 784), n, 784)
rule <- matrix(rnorm(784 * 10), 784, 10)
y_train <- keras$utils$to_categorical(max.col(x_train %*% rule) - 1L, 10L)

train <- function(s) {
  keras$utils$set_random_seed(1L) # the same initial weights under every strategy
  with(s$scope(), {
    model <- keras$Sequential(list(
      keras$Input(shape = list(784L)),
      keras$layers$Dense(units = 256L, activation = "relu"),
      keras$layers$Dropout(rate = dropout[1]),
      keras$layers$Dense(units = 128L, activation = "relu"),
      keras$layers$Dropout(rate = dropout[2]),
      keras$layers$Dense(units = 10L, activation = "softmax")
    ))
  })
  model$compile(
    loss = "categorical_crossentropy",
    optimizer = keras$optimizers$RMSprop(),
    metrics = list("accuracy")
  )
  keras$utils$set_random_seed(2L) # the same shuffling under every strategy
  history <- model$fit(
    x_train, y_train,
    epochs = epochs, batch_size = 128L, validation_split = 0.2, verbose = 0L
  )
  list(weights = model$get_weights(), history = history$history)
}

results <- list()
for (name in names(strategy)) {
  if (name != "one_device" && !(name %in% wanted)) next
  started <- Sys.time()
  results[[name]] <- train(strategy[[name]])
  h <- results[[name]]$history
  difference <- max(mapply(function(a, b) max(abs(a - b)), results[[name]]$weights, results$one_device$weights))
  cat(sprintf(
    "replica %d: %-20s replicas %d  %5.1f s  loss %.4f  val_accuracy %.4f  max |w - w_one_device| %.3g\n",
    replica, name, strategy[[name]]$num_replicas_in_sync, as.numeric(Sys.time() - started, units = "secs"),
    tail(h$loss, 1), tail(h$val_accuracy, 1), difference
  ))
  if (all(dropout == 0) && difference > 1e-5) {
    stop(sprintf("%s ended %.3g away from the one-device weights (dropout 0: expected < 1e-5)", name, difference))
  }
}

# The end of the distributed program: replica 0 waits for the other replicas here, and this
# fails (a phalanx ReplicaFailedError naming the replica and its error) if one of them failed.
for (s in strategy) s$close()
