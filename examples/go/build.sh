#!/usr/bin/env bash
# Builds examples/go (the queuedemo command) without a network, from Debian's
# packages (`./dev test` installs them when missing; exit status 3 when one is):
# golang-go, golang-google-grpc-dev, golang-google-protobuf-dev,
# golang-github-golang-protobuf-1-5-dev, protoc-gen-go and protoc-gen-go-grpc.
# grpc-go 1.33 decodes messages through github.com/golang/protobuf: its 1.3 package
# (the one apt picks for golang-google-grpc-dev by default) cannot decode the
# protobuf-go 1.28 stubs and panics; the 1.5 package, built on protobuf-go, can.
#
#   examples/go/build.sh OUT_DIR     writes OUT_DIR/bin/queuedemo
#   examples/go/build.sh --check     only checks that the packages are there
#
# Debian's Go library packages put their source in /usr/share/gocode/src, a GOPATH
# tree without a module cache or go.sum, so the build runs in GOPATH mode
# (GO111MODULE=off) with GOPATH=OUT_DIR:/usr/share/gocode: the program and its
# generated stubs are laid out under OUT_DIR/src/example.com/queuedemo, and every
# import resolves in one of the two trees. The stubs are generated here, from
# proto/, by buf with the local plugins of examples/go/buf.gen.yaml; go vet checks the
# program before it is built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
[ $# -eq 1 ] || { echo "usage: $0 OUT_DIR | --check" >&2; exit 2; }
gocode=/usr/share/gocode

missing=()
for tool in go protoc-gen-go protoc-gen-go-grpc; do
  command -v "$tool" >/dev/null || missing+=("$tool")
done
for lib in google.golang.org/grpc google.golang.org/protobuf; do
  [ -d "$gocode/src/$lib" ] || missing+=("$gocode/src/$lib")
done
# proto/registry.go: github.com/golang/protobuf 1.4 or newer.
[ -f "$gocode/src/github.com/golang/protobuf/proto/registry.go" ] ||
  missing+=("github.com/golang/protobuf 1.4 or newer in $gocode/src")
if [ ${#missing[@]} -gt 0 ]; then
  echo "missing: ${missing[*]} (Debian: apt-get install golang-go golang-google-grpc-dev" \
    "golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev protoc-gen-go" \
    "protoc-gen-go-grpc; ./dev test installs them when run as root)" >&2
  exit 3
fi
[ "$1" != --check ] || exit 0
mkdir -p "$1"
out="$(cd "$1" && pwd)"

# The buf of the TypeScript client's lockfile (./dev setup installs it), else npx.
buf="$root/clients/typescript/node_modules/.bin/buf"
[ -x "$buf" ] || buf=(npx --yes @bufbuild/buf@1.75.0)

pkg="$out/src/example.com/queuedemo"
rm -rf "$pkg"
mkdir -p "$pkg" "$out/bin"
cp "$here/main.go" "$pkg/"
(cd "$root" && "${buf[@]}" generate proto --template examples/go/buf.gen.yaml -o "$pkg")
# The build cache defaults to $HOME/.cache/go-build; a run without HOME keeps it here.
[ -n "${HOME:-}" ] || [ -n "${GOCACHE:-}" ] || export GOCACHE="$out/.gocache"
export GO111MODULE=off GOPATH="$out:$gocode" GOFLAGS=
go vet example.com/queuedemo
go build -o "$out/bin/queuedemo" example.com/queuedemo
