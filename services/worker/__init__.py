"""The worker: one model replica behind ballast.v1.Worker, registered in etcd."""
