// Command etcd is etcd's own server main (go.etcd.io/etcd/server/v3/etcdmain) at the version
// the pinned Kubernetes release requires, so the API server runs on the etcd it was tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
