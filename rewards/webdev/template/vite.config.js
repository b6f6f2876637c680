// The grader's build configuration: the same for every submission (a submission's own copy is ignored).
export default {
  cacheDir: "/tmp/vite-cache",
  logLevel: "warn",
  build: { outDir: "dist", emptyOutDir: true, sourcemap: true, assetsInlineLimit: 0 },
};
